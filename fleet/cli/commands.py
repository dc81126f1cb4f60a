"""``edge-fleet run``, ``compare`` and ``demo``: argument handling around the runner."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from edge_agent.methods import CORE, METHODS, device_method
from fleet.cli.options import parse_seeds, resolve_data_options, split_list
from fleet.cli.resume import run_or_resume, sweep_dir
from fleet.data.bundles import ensure_bundle, resolve_bundle
from fleet.data.partition import Partition, digits5, from_directory, from_npz
from fleet.report import summary as report_mod
from fleet.report.central import CENTRAL, CENTRAL_TRAIN
from fleet.report.central import run as run_central
from fleet.report.contribution import backbone_contribution
from fleet.report.plots import plot_contribution
from fleet.transports.mqtt import parse_broker_url
from fleet.transports.protocols import protocol_train
from fleet.transports.runner import run as run_fleet
from fleet.transports.spec import RunResult, RunSpec
from runtime.cliutil import UsageError, check_output_folder
from runtime.runlock import AlreadyRunning, RunLock

BIN = Path(sys.executable).parent


def partition_for(args: argparse.Namespace, seed: int) -> Partition:
    if args.data is None:
        return digits5(clients=args.clients, split=args.split, seed=seed, train=args.train,
                       test=args.test, alpha=args.alpha, domain=args.domain)  # fmt: skip
    if not args.data.exists():
        raise UsageError(f"--data {args.data} does not exist")
    if args.data.suffix == ".npz":
        return from_npz(args.data)
    return from_directory(args.data, image_size=args.image_size, seed=seed)


def spec_for(
    args: argparse.Namespace,
    *,
    method: str,
    bundle: Path,
    seed: int,
    out: Path,
    **extra: Any,
) -> RunSpec:
    """One run of a sweep from the shared options. Every run of a sweep shares one feature
    cache under ``--out``: the backbones see each image once, whatever the method. The
    [train] table layers, each over the one before: what ``--protocol`` gives the method
    (:mod:`fleet.transports.protocols`), ``--train-param``, and the sweep's own settings (DP-SGD's GroupNorm)."""
    base = protocol_train(args.protocol, method)
    extra["extra_train"] = {**base, **args.train_param, **extra.get("extra_train", {})}
    return RunSpec(
        method=method,
        rounds=args.rounds,
        bundle=bundle,
        out=out,
        seed=seed,
        transport=args.transport,
        broker=args.broker,
        workers=args.workers,
        out_dim=args.out_dim,
        epochs=args.epochs,
        downlink_budget=args.downlink_budget,
        stats_dim=args.stats_dim,
        progress=not args.no_progress,
        feature_cache=args.out / "feature-cache",
        **extra,
    )


def hold_output_folder(out: Path) -> RunLock:
    """Two sweeps into one --out would overwrite each other's report (and a --resume
    beside the sweep it resumes would run its runs twice): the second is refused. Hold the
    returned lock for the sweep (``with``)."""
    try:
        return RunLock.take(
            out / ".lock",
            what=f"--out {out}",
            remedy="wait for that sweep to end or choose another --out",
        )
    except AlreadyRunning as exc:
        raise UsageError(str(exc)) from None


def check_options(args: argparse.Namespace, *, method: str, seed: int) -> Partition:
    """Everything a sweep's options can get wrong (broker URL, run settings, data), checked
    before the zoo is built, which takes minutes the first time. Returns the partition of
    ``seed``, which the sweep then reuses."""
    resolve_bundle(args)
    resolve_data_options(args)
    check_output_folder(args.out, option="--out")
    if args.transport != "mqtt":
        name = args.transport
        if args.broker:
            raise UsageError(f"--broker applies to --transport mqtt; the {name} transport has none")
        if args.workers is not None:
            raise UsageError(
                f"--workers applies to --transport mqtt; the {name} transport runs every "
                "client in this one process"
            )
    if args.transport == "vector":
        vector_options(args, method=method)
    if args.workers is None:
        args.workers = 2
    if args.broker:
        parse_broker_url(args.broker)
    spec_for(args, method=method, bundle=args.bundle, seed=seed, out=args.out)
    return partition_for(args, seed)


def vector_options(args: argparse.Namespace, *, method: str) -> None:
    """What the vector engine does not implement, refused before anything starts."""
    from fleet.engine.batch import unsupported

    refusal = unsupported(method)
    if refusal is not None:
        raise UsageError(refusal)
    if getattr(args, "resume", False):
        raise UsageError(
            "--resume needs --transport memory or mqtt: the vector engine keeps no "
            "per-device state to resume from"
        )


def compare(args: argparse.Namespace, methods: list[str], seeds: list[int]) -> dict[str, Path]:
    if args.transport == "vector":
        for method in methods:
            vector_options(args, method=method)
    first = check_options(args, method=methods[0], seed=seeds[0])
    with hold_output_folder(args.out):  # after every check: a usage error leaves no folder
        return _sweep(args, methods, seeds, first)


def _sweep(
    args: argparse.Namespace, methods: list[str], seeds: list[int], first: Partition
) -> dict[str, Path]:
    bundle = ensure_bundle(args.bundle, args.zoo_size, backbone=args.backbone or "zoo")
    sweep = sweep_dir(args.out, resume=args.resume)
    results: dict[str, dict[int, RunResult]] = {m: {} for m in methods}
    description = ""
    for seed in seeds:
        # The same partition for every method.
        partition = first if seed == seeds[0] else partition_for(args, seed)
        description = partition.description.replace(f", seed {seed}", "")
        # The methods, then the ceiling on the same partition and feature cache.
        for method in [*methods, CENTRAL]:
            central = method == CENTRAL
            spec = spec_for(args, method=method, bundle=bundle, seed=seed,
                            out=sweep / f"{method}-seed{seed}",
                            **({"extra_train": CENTRAL_TRAIN} if central else {}))  # fmt: skip
            result, resumed = run_or_resume(
                spec, partition, run=run_central if central else run_fleet
            )
            results.setdefault(method, {})[seed] = result
            summary = report_mod.run_summary(result)
            how = "read back" if resumed else f"{result.wall_seconds:.0f} s"
            print(f"{method:>9} seed {seed}: final mean accuracy {summary['final_mean']:.3f}, "
                  f"best {summary['best_mean']:.3f} at round {summary['best_round']} ({how})",
                  file=sys.stderr, flush=True)  # fmt: skip
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("command", "log_format", "log_level")}  # fmt: skip
    config.update(methods=methods, seeds=seeds, bundle=str(bundle))
    document = report_mod.build_report(results, config=config, partition=description)
    # The contribution heatmap of the first method that ran with a trained head (the core
    # one if present): it reads each device's saved head.
    heat_method = next(
        (m for m in (CORE, *methods) if m in results and device_method(m).trains_head), None
    )
    run0 = results[heat_method or methods[0]][seeds[0]]
    extra: dict[str, Path] = {}
    if run0.spec.transport == "vector" or heat_method is None:
        # The heat map reads each device's saved head; the vector engine saves none.
        document["backbone_contribution"] = None
        return report_mod.write(document, args.out, extra_plots=extra)
    domains, backbones, matrix = backbone_contribution(run0, bundle)
    document["backbone_contribution"] = {
        "method": heat_method, "seed": seeds[0], "domains": domains, "backbones": backbones,
        "similarity": matrix.round(4).tolist(),
    }  # fmt: skip
    extra["contribution"] = plot_contribution(
        domains, backbones, matrix, args.out / "backbone_contribution.png", method=heat_method
    )
    return report_mod.write(document, args.out, extra_plots=extra)


def _print(paths: dict[str, Path]) -> None:
    print(paths["report.md"].read_text())
    for name, path in paths.items():
        print(f"{name:>14}: {path}")


def cmd_run(args: argparse.Namespace) -> int:
    _print(compare(args, [args.method], [args.seed]))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    methods = split_list(args.methods, what="methods", allowed=METHODS)
    _print(compare(args, methods, parse_seeds(args.seeds)))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return cmd_compare(args)
