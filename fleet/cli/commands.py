"""``edge-fleet run``, ``compare`` and ``demo``: the options resolved once, then every
method x seed run (and the ceiling) on the same partitions, and the report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edge_agent.methods import CORE, METHODS, device_method
from fleet.cli.options import (
    SweepOptions,
    check_method,
    parse_seeds,
    refuse_vector,
    split_list,
    sweep_options,
)
from fleet.cli.resume import run_or_resume, sweep_dir
from fleet.data.bundles import ensure_basis, ensure_bundle
from fleet.data.partition import Partition
from fleet.report import summary as report_mod
from fleet.report.central import CENTRAL, CENTRAL_TRAIN
from fleet.report.central import run as run_central
from fleet.report.plots import plot_contribution
from fleet.transports.configs import announcement_refusal
from fleet.transports.runner import run as run_fleet
from fleet.transports.spec import RunResult
from runtime.cliutil import UsageError
from runtime.runlock import AlreadyRunning, RunLock


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


def compare(args: argparse.Namespace, methods: list[str], seeds: list[int]) -> dict[str, Path]:
    """Every method and seed, and the ceiling, on the same bundle and partitions: the
    report's files by name."""
    if args.transport == "vector":
        for method in methods:
            refuse_vector(method, resume=args.resume)
    options = sweep_options(args, method=methods[0])
    for method in methods[1:]:  # the first was checked by sweep_options
        check_method(options, method)
    # Everything a sweep's options can get wrong is checked before the zoo is built, which
    # takes minutes the first time: the data too, whose first partition the sweep reuses.
    refuse_large_announcements(options, methods, seeds[0])
    first = options.data.partition(seeds[0])
    with hold_output_folder(options.out):  # after every check: a usage error leaves no folder
        return _sweep(options, methods, seeds, first)


def refuse_large_announcements(options: SweepOptions, methods: list[str], seed: int) -> None:
    """A round announcement larger than the agents take, refused from the clients' names,
    the classes, dim and dtype: before their data is made (minutes at hundreds of clients),
    the zoo is built or any run starts. The runs ask again with the bundle's sizes."""
    planned = options.data.planned_clients(seed)
    if planned is None:
        return
    names, classes = planned
    for method in methods:
        spec = options.spec(method=method, seed=seed, out=options.out)
        refused = announcement_refusal(spec, classes, names, feature_dim=None)
        if refused is not None:
            raise UsageError(refused)


def _sweep(
    options: SweepOptions, methods: list[str], seeds: list[int], first: Partition
) -> dict[str, Path]:
    bundle = ensure_bundle(options.bundle, options.zoo_size, backbone=options.backbone)
    if options.stats_basis:
        ensure_basis(bundle)
    sweep = sweep_dir(options.out, resume=options.resume)
    results: dict[str, dict[int, RunResult]] = {m: {} for m in methods}
    description = ""
    for seed in seeds:
        # The same partition for every method.
        partition = first if seed == seeds[0] else options.data.partition(seed)
        description = partition.description.replace(f", seed {seed}", "")
        # The methods, then the ceiling on the same partition and feature cache.
        for method in [*methods, CENTRAL]:
            central = method == CENTRAL
            spec = options.spec(method=method, seed=seed, out=sweep / f"{method}-seed{seed}",
                                extra_train=CENTRAL_TRAIN if central else None,
                                plain=central)  # fmt: skip
            result, resumed = run_or_resume(
                spec, partition, run=run_central if central else run_fleet
            )
            results.setdefault(method, {})[seed] = result
            summary = report_mod.run_summary(result)
            how = "read back" if resumed else f"{result.wall_seconds:.0f} s"
            print(f"{method:>9} seed {seed}: final mean accuracy {summary['final_mean']:.3f}, "
                  f"best {summary['best_mean']:.3f} at round {summary['best_round']} ({how})",
                  file=sys.stderr, flush=True)  # fmt: skip
    config = {**options.config, "methods": methods, "seeds": seeds, "bundle": str(bundle)}
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
        return report_mod.write(document, options.out, extra_plots=extra)
    # torch: the trained heads are read back only here, after the options were checked.
    from fleet.report.contribution import backbone_contribution

    domains, backbones, matrix = backbone_contribution(run0, bundle)
    document["backbone_contribution"] = {
        "method": heat_method, "seed": seeds[0], "domains": domains, "backbones": backbones,
        "similarity": matrix.round(4).tolist(),
    }  # fmt: skip
    extra["contribution"] = plot_contribution(
        domains, backbones, matrix, options.out / "backbone_contribution.png", method=heat_method
    )
    return report_mod.write(document, options.out, extra_plots=extra)


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
