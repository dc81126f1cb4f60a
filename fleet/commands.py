"""``edge-fleet run``, ``compare`` and ``demo``: argument handling around the runner."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from edge_agent.train_config import METHODS
from fleet import report as report_mod
from fleet.central import CENTRAL, CENTRAL_TRAIN
from fleet.central import run as run_central
from fleet.partition import SPLITS, Partition, digits5, from_directory, from_npz
from fleet.protocols import PROTOCOLS, protocol_train
from fleet.resume import run_or_resume, sweep_dir
from fleet.runner import TRANSPORTS, RunResult, RunSpec, parse_broker_url
from fleet.runner import run as run_fleet
from runtime.cliutil import CommandFailed, UsageError, check_output_folder
from runtime.runlock import AlreadyRunning, RunLock
from runtime.settings import parse_value

BIN = Path(sys.executable).parent
DATA_HELP = """data:
  digits-5 (default) is built locally from scikit-learn's bundled digits and photos.
  --data FILE.npz   train_x_<i>, train_y_<i>, test_x_<i>, test_y_<i> (x uint8 or float32
                    in N,3,H,W; y integers) and optionally domain_<i>, for clients 0..N-1
  --data DIR        DIR/<client>/train/<class>/*, DIR/<client>/test/<class>/* (one
                    client per folder), or DIR/<domain>/<class>/* (Digit-5, Office-10,
                    DomainNet laid out as folders: one client per domain, 30% for testing)
"""


class TrainParams(argparse.Action):
    """``--train-param KEY=VALUE``, repeatable, gathered into one dict."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        key, sep, raw = str(values).partition("=")
        key = key.strip()
        if not sep or not key:
            parser.error(f"{option_string} expects KEY=VALUE, got {values!r}")
        if key in ("out_dim", "epochs"):
            parser.error(f"{option_string} {key}: use --{key.replace('_', '-')}")
        # A copy: argparse hands every parse the same default dict.
        params = {**getattr(namespace, self.dest), key: parse_value(raw.strip())}
        setattr(namespace, self.dest, params)


def add_common_options(
    parser: argparse.ArgumentParser,
    *,
    rounds: int,
    clients: int,
    out: str,
    one_split: bool = True,
) -> None:
    """The data, federation and output options. ``one_split=False`` hides ``--split`` from
    the help of a command that sweeps several (it still parses, to be refused by name)."""
    data = parser.add_argument_group("data")
    data.add_argument("--data", type=Path, help="an .npz of clients or a folder (see below)")
    # The digits-5 options default to None so that one given with --data, where it would
    # be ignored, can be told from a default (see resolve_data_options).
    data.add_argument("--split", choices=SPLITS,
                      help="digits-5 non-IID setting (default feature)" if one_split
                      else argparse.SUPPRESS)  # fmt: skip
    data.add_argument("--clients", type=int,
                      help=f"digits-5 clients (default {clients})")  # fmt: skip
    data.add_argument("--alpha", type=float,
                      help="Dirichlet alpha of the label splits (default 0.5)")  # fmt: skip
    data.add_argument("--domain",
                      help="digits-5 domain of the label split (default clean)")  # fmt: skip
    data.add_argument("--train", type=int,
                      help="digits-5 training images per client (default 100)")  # fmt: skip
    data.add_argument("--test", type=int,
                      help="digits-5 test images per client (default 100)")  # fmt: skip
    parser.set_defaults(digits5_defaults={"split": "feature", "clients": clients, "alpha": 0.5,
                                          "domain": "clean", "train": 100, "test": 100})  # fmt: skip
    data.add_argument("--image-size", type=int,
                      help="side that --data folder images are resized to (default 32; 224 "
                           "with --backbone effnet-lite0)")  # fmt: skip
    fl = parser.add_argument_group("federation")
    fl.add_argument("--rounds", type=int, default=rounds, help=f"rounds (default {rounds})")
    fl.add_argument("--epochs", type=int, default=1, help="local epochs per round (default 1)")
    fl.add_argument("--out-dim", type=int, default=256, help="projection head size (default 256)")
    fl.add_argument("--protocol", choices=list(PROTOCOLS), default="fair",
                    help="fair (default): every method with a classifier has a plain linear "
                         "one; paper: the bounded classifier of FedPCL's released code for "
                         "every method that has one (docs/fleet.md)")  # fmt: skip
    fl.add_argument("--train-param", action=TrainParams, default={}, metavar="KEY=VALUE",
                    help="any other key of the agents' [train] table (edge-agent example-config) "
                         "for every method, over the protocol's settings, e.g. tau=0.2, "
                         "fpl_tau=0.07, lr=1e-4, norm=group; repeatable")  # fmt: skip
    fl.add_argument("--bundle", type=Path,
                    help="backbone bundle; --backbone is built there if missing (default runs/BACKBONE)")  # fmt: skip
    fl.add_argument("--backbone", choices=list(BACKBONES),
                    help="what a missing --bundle is built as: zoo (glyph-pretrained, 32x32) or "
                         "effnet-lite0 (ImageNet EfficientNet-Lite0, images resized to 224; the "
                         "imagenet extra) (default zoo)")  # fmt: skip
    fl.add_argument("--zoo-size", choices=["small", "full"], default="full",
                    help="zoo to build when --bundle is missing (default full, ~5 min once)")  # fmt: skip
    tr = parser.add_argument_group("transport")
    tr.add_argument("--transport", choices=TRANSPORTS, default="mqtt",
                    help="mqtt: broker + processes; memory: one process, no broker (default mqtt)")  # fmt: skip
    tr.add_argument("--broker", help="external broker mqtt://host:port (default: start one)")
    tr.add_argument("--workers", type=int,
                    help="worker processes hosting the agents over mqtt (default 2)")  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path(out), help=f"report folder (default {out})"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest sweep under --out after a crash or Ctrl-C: runs that "
        "finished are read back, the others run again from round 0",
    )


def add_parsers(sub: Any) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p_run = sub.add_parser("run", help="run one method over a simulated fleet and report",
                           description="Run R rounds of one method over N agents.",
                           epilog=DATA_HELP, formatter_class=fmt)  # fmt: skip
    p_run.add_argument("--method", choices=METHODS, default="fedpcl", help="default fedpcl")
    p_run.add_argument("--seed", type=int, default=0)
    add_common_options(p_run, rounds=30, clients=5, out="runs/fleet")

    p_cmp = sub.add_parser("compare", help="several methods x seeds on the same partitions",
                           description="Every method and seed on the same bundle and partitions.",
                           epilog=DATA_HELP, formatter_class=fmt)  # fmt: skip
    p_cmp.add_argument("--methods", default=",".join(METHODS),
                       help=f"comma-separated (default {','.join(METHODS)})")  # fmt: skip
    p_cmp.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    add_common_options(p_cmp, rounds=30, clients=5, out="runs/compare")

    p_demo = sub.add_parser("demo", help="what `make demo` runs: solo, fedavg, fedproto and "
                            "fedpcl on 5 feature-shifted devices over MQTT",
                            description="The feature-shift comparison of solo, fedavg, fedproto "
                            "and fedpcl with 5 devices over a private Mosquitto.")  # fmt: skip
    p_demo.add_argument("--seeds", default="0", help="comma-separated (default 0)")
    p_demo.add_argument("--methods", default="solo,fedavg,fedproto,fedpcl")
    add_common_options(p_demo, rounds=30, clients=5, out="runs/demo")


def split_list(text: str, *, what: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError(f"--{what} is empty")
    twice = sorted({i for i in items if items.count(i) > 1})
    if twice:  # a seed run twice would count twice in the mean over seeds
        raise UsageError(f"--{what} lists {', '.join(twice)} more than once")
    if allowed is not None:
        bad = [i for i in items if i not in allowed]
        if bad:
            raise UsageError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


def parse_seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in split_list(text, what="seeds")]
    except ValueError as exc:
        raise UsageError(f"--seeds must be integers: {exc}") from exc


#: ``--backbone``: the ``edge-export`` arguments that build each into a bundle folder.
BACKBONES: dict[str, list[str]] = {
    "zoo": ["zoo"],
    "effnet-lite0": ["bundle", "--backbone", "name=effnet-lite0,pretrained=efficientnet-lite0"],
}


def resolve_bundle(args: argparse.Namespace) -> None:
    """``--bundle`` defaults to runs/BACKBONE; a bundle already there must be what an
    explicit ``--backbone`` asks for (a zoo silently used for effnet-lite0 would mislead)."""
    backbone = args.backbone or "zoo"
    if args.bundle is None:
        args.bundle = Path("runs") / backbone
    if args.backbone is None or not (args.bundle / "bundle.json").exists():
        return
    from export import bundle as bundle_mod
    from export.errors import BundleError

    try:
        held = bundle_kind(bundle_mod.load(args.bundle, check_hashes=False))
    except BundleError as exc:
        raise UsageError(str(exc)) from None
    if held != args.backbone:
        raise UsageError(
            f"--bundle {args.bundle} holds {held or 'other backbones'}, not --backbone "
            f"{args.backbone}; choose another --bundle (or none: runs/{args.backbone})"
        )


def bundle_kind(bundle: Any) -> str | None:
    """Which ``--backbone`` built ``bundle`` (None: neither)."""
    if "zoo" in bundle.extra:
        return "zoo"
    pretrained = [m.provenance.get("pretrained") for m in bundle.members]
    return "effnet-lite0" if pretrained == ["efficientnet-lite0"] else None


def ensure_bundle(path: Path, size: str, *, backbone: str = "zoo") -> Path:
    """``path`` if it holds a bundle; else ``backbone`` (the zoo of ``size``, or a
    pretrained backbone), built there once.

    The zoo is built in a staging folder beside ``path`` and moved into place when it is
    whole: a build cut short (Ctrl-C in the minutes it takes) leaves no half-written
    bundle at ``path`` for the next run to trip over, and the next run starts it afresh.
    """
    if (path / "bundle.json").exists():
        return path
    # Two sweeps started at once on a fresh clone: the second waits for the first's build
    # (it used to delete the first's staging folder as an interrupted build's leftover).
    with RunLock.take(
        path.with_name(f".{path.name}.lock"),
        what=f"the zoo in {path}",
        wait=lambda message: print(message, file=sys.stderr, flush=True),
    ) as lock:
        if (path / "bundle.json").exists():
            return path  # the other sweep built it
        if path.exists() and any(path.iterdir()):
            raise UsageError(f"{path} exists but holds no bundle.json")
        staging = path.with_name(f".{path.name}.building")
        if staging.exists():
            shutil.rmtree(staging)  # what an interrupted build left
        what = f"the {size} backbone zoo" if backbone == "zoo" else backbone
        print(f"building {what} in {path} (once) ...", file=sys.stderr, flush=True)
        argv = [str(BIN / "edge-export"), *BACKBONES[backbone], "--out", str(staging)]
        done = subprocess.run(
            argv + (["--size", size] if backbone == "zoo" else []), stdout=subprocess.DEVNULL
        )
        if done.returncode != 0:
            raise CommandFailed(f"building {what} failed (exit {done.returncode})")
        staging.replace(path)  # onto nothing or an empty folder: atomic
        # Safe to remove now that bundle.json is there: a waiter holding the old file's
        # lock, and anyone later, finds the bundle first and never builds.
        lock.path.unlink(missing_ok=True)
        return path


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
    (:mod:`fleet.protocols`), ``--train-param``, and the sweep's own settings (DP-SGD's GroupNorm)."""
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
        progress=not args.no_progress,
        feature_cache=args.out / "feature-cache",
        **extra,
    )


def resolve_data_options(args: argparse.Namespace) -> None:
    """Fill in the digits-5 options' defaults, or, with --data, refuse any that was given:
    the clients of an .npz or a folder are what they hold, and a --clients 20 that quietly
    ran the file's 5 would mislead."""
    defaults = args.__dict__.pop("digits5_defaults", None)
    if defaults is None:
        return  # resolved already
    given = [f"--{name}" for name in defaults if getattr(args, name) is not None]
    folders = args.data is not None and args.data.is_dir()
    if args.image_size is not None and not folders:
        raise UsageError("--image-size applies to --data image folders only")
    if args.image_size is None:  # the backbones' input side: no detail lost before they resize
        args.image_size = 224 if args.backbone == "effnet-lite0" else 32
    if args.image_size < 1:
        raise UsageError(f"--image-size must be positive, got {args.image_size}")
    if args.data is not None:
        if given:
            raise UsageError(
                f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} the built-in "
                f"digits-5 data and do{'es' if len(given) == 1 else ''} not apply to "
                f"--data: its clients are those {args.data} holds"
            )
        return
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # An option no chosen split reads would be dropped without a word.
    splits = getattr(args, "swept_splits", None) or [args.split]
    readers_of = {
        "--alpha": ("label", "feature-label"),
        "--domain": ("label",),
    }
    for option, readers in readers_of.items():
        if option in given and not set(readers) & set(splits):
            raise UsageError(
                f"{option} applies to --split {' and '.join(readers)} only, "
                f"not to {', '.join(splits)}"
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
    if args.transport == "memory":
        if args.broker:
            raise UsageError("--broker applies to --transport mqtt; the memory transport has none")
        if args.workers is not None:
            raise UsageError(
                "--workers applies to --transport mqtt; the memory transport runs every agent "
                "in this one process"
            )
    if args.workers is None:
        args.workers = 2
    if args.broker:
        parse_broker_url(args.broker)
    spec_for(args, method=method, bundle=args.bundle, seed=seed, out=args.out)
    return partition_for(args, seed)


def compare(args: argparse.Namespace, methods: list[str], seeds: list[int]) -> dict[str, Path]:
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
    # The contribution heatmap of the first federated method that ran (FedPCL if present).
    heat_method = next((m for m in ("fedpcl", *methods) if m in results), methods[0])
    run0 = results[heat_method][seeds[0]]
    extra = {}
    domains, backbones, matrix = report_mod.backbone_contribution(run0, bundle)
    document["backbone_contribution"] = {
        "method": heat_method, "seed": seeds[0], "domains": domains, "backbones": backbones,
        "similarity": matrix.round(4).tolist(),
    }  # fmt: skip
    extra["contribution"] = report_mod.plot_contribution(
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
