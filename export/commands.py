"""What each ``edge-export`` command does; export/cli.py holds its parser and imports this
module only once a command runs, since every command here builds, loads or times models."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from export import architectures, bench, builder, photos
from export import bundle as bundle_mod
from export.errors import BundleError, ExportError
from export.sources import PRETRAINED, Source, load
from export.zoo import build_zoo, member_indices
from runtime.cliutil import UsageError, check_output_folder
from runtime.npz import NpzError, read_npz


def _progress(desc: str, total: int) -> Any:
    # disable=None: a bar on a terminal, nothing in logs and CI (no carriage-return floods).
    return tqdm(
        total=total,
        desc=desc,
        unit="img",
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
        disable=None,
    )


def _prepare_out(out: Path, force: bool) -> None:
    if (out / "bundle.json").exists() and not force:
        raise UsageError(f"{out} already holds a bundle; pass --force to overwrite it")
    check_output_folder(out, option="--out")


def cmd_zoo(args: argparse.Namespace) -> int:
    members = None
    if args.members is not None:
        members = tuple(m.strip() for m in args.members.split(",") if m.strip())
        try:
            member_indices(members)
        except ValueError as exc:
            raise UsageError(f"--members: {exc}") from None
    _prepare_out(args.out, args.force)
    bundle, report = build_zoo(
        args.out,
        size=args.size,
        seed=args.seed,
        precision=args.precision,
        progress_factory=_progress,
        members=members,
    )
    for name, info in report["source_tasks"].items():
        print(
            f"{name:<11} {info['architecture']:<18} {info['task']:<8} source accuracy {info['accuracy']:.3f}  ({info['seconds']:.0f} s)",
            file=sys.stderr,
        )
    print(json.dumps(report, indent=2))
    print(
        f"bundle {bundle.id[:16]}... written to {args.out} ({bundle.feature_dim} features)",
        file=sys.stderr,
    )
    return 0


def _load_samples(path: Path) -> Any:
    try:
        x = read_npz(path, required=("x",))["x"]
    except NpzError as exc:
        raise UsageError(f"cannot read samples: {exc}") from None
    if x.ndim != 4:
        raise UsageError(f"{path}: x must be 4-D images, got shape {x.shape}")
    if x.shape[-1] == 3 and x.shape[1] != 3:
        x = x.transpose(0, 3, 1, 2)
    x = x.astype(np.float32)
    if x.max() > 1.0:
        x /= 255.0
    return x[:256]


def cmd_bundle(args: argparse.Namespace) -> int:
    _prepare_out(args.out, args.force)
    try:
        loaded = [load(Source.parse(spec)) for spec in args.backbone]
        held_out = None  # with --samples, the builder holds every other image out
        if args.samples:
            images = _load_samples(args.samples)
        else:
            images, held_out = photos.sample_sets(max(item.input_shape[-1] for item in loaded))
        _, report = builder.build(
            loaded, args.out, images=images, held_out=held_out, precision=args.precision
        )
    except ExportError as exc:
        raise UsageError(str(exc)) from exc
    print(json.dumps(report, indent=2))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    report = builder.verify(args.bundle)
    print(json.dumps(report, indent=2))
    for problem in report["problems"]:
        print(f"edge-export: verify: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


def cmd_basis(args: argparse.Namespace) -> int:
    # Lazy, as the zoo's renderer and the runtime are: only this command needs them.
    from export.basis import TASKS, write_basis

    if args.per_task < 2:
        raise UsageError(f"--per-task must be at least 2, got {args.per_task}")
    try:
        with tqdm(total=len(TASKS) * args.per_task, desc="basis: features", unit="image",
                  file=sys.stderr) as bar:  # fmt: skip
            out = write_basis(args.bundle, per_task=args.per_task, progress=bar)
    except (BundleError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    print(f"public basis written to {out}", file=sys.stderr)
    print(json.dumps({"basis": str(out)}))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    path = Path(args.target)
    if path.is_dir():
        if args.input is not None:  # a bundle's backbones have their own input sides
            raise UsageError(f"--input applies to an architecture; {path} is a bundle")
        try:
            targets = bench.targets_for_bundle(bundle_mod.load(path))
        except (BundleError, ValueError) as exc:
            raise UsageError(str(exc)) from exc
    elif args.target in architectures.ARCHITECTURES:
        side = 224 if args.input is None else args.input
        if side < 1:
            raise UsageError(f"--input must be positive, got {side}")
        targets = bench.targets_for_arch(args.target, side)
    else:
        raise UsageError(
            f"{args.target!r} is neither a bundle directory nor an architecture ({', '.join(architectures.ARCHITECTURES)})"
        )
    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise UsageError(
            f"--batches takes comma-separated integers, got {args.batches!r}"
        ) from None
    if min(batches) < 1 or args.min_time <= 0:
        raise UsageError("--batches must be positive and --min-time above 0")
    results = bench.run(targets, batches=batches, min_time=args.min_time)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for device, label in results["devices"].items():
        print(f"{device} ({label}), images/s:")
        for batch, rows in results["batches"].items():
            row = rows.get(device, {})
            figures = "  ".join(f"{k} {v:,.1f}" for k, v in row.items() if not k.count("_vs_"))
            ratios = "  ".join(f"{k} {v:.2f}" for k, v in row.items() if k.count("_vs_"))
            print(f"  batch {batch:>3}: {figures}  |  {ratios}")
        for arm, cos in results["cosine_vs_cpu_fp32"].get(device, {}).items():
            low = "n/a" if cos["min"] is None else f"{cos['min']:.4f}"
            print(f"  {arm} feature cosine vs fp32 on the CPU provider: min {low}")
    for arm, why in results["skipped"].items():
        print(f"skipped {arm}: {why}")
    return 0


def cmd_archs(args: argparse.Namespace) -> int:
    for name, arch in architectures.ARCHITECTURES.items():
        print(f"{name:<20} {arch.description}")
    print("\npretrained backbones (--backbone name=ID,pretrained=NAME):")
    for name, spec in PRETRAINED.items():
        print(f"{name:<20} {spec.description}")
    return 0


#: The handler of each subcommand of export/cli.py::build_parser, by name.
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "zoo": cmd_zoo,
    "bundle": cmd_bundle,
    "verify": cmd_verify,
    "basis": cmd_basis,
    "bench": cmd_bench,
    "archs": cmd_archs,
}
