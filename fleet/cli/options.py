"""What ``edge-fleet run``, ``compare``, ``demo`` and ``privacy`` were asked, resolved once
from the parsed command line into frozen options and checked before anything starts (the
zoo build takes minutes the first time): the data, the runs' settings, the transport, the
output. Nothing downstream reads the argparse namespace, and nothing writes to it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from closed_form.basis import BASIS_FILE
from fleet.data.bundles import resolve_bundle
from fleet.data.digits5 import CLASSES as DIGIT_CLASSES
from fleet.data.partition import Partition, digits5, digits5_clients, from_directory, from_npz
from fleet.transports.configs import planned_workers_refusal
from fleet.transports.mqtt import broker_refusal, parse_broker_url
from fleet.transports.protocols import protocol_train
from fleet.transports.runner import vector_refusal
from fleet.transports.spec import RunSpec
from runtime.cliutil import UsageError, check_output_folder

#: The parsed names that belong to the entry point or the parser, not to a sweep.
_NOT_REPORTED = frozenset({"command", "log_format", "log_level", "digits5_defaults"})


@dataclass(frozen=True, kw_only=True)
class Digits5Options:
    """How the built-in digits-5 data is made (fleet/data/partition.py::digits5)."""

    split: str
    clients: int
    alpha: float
    domain: str
    train: int
    test: int


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """The clients of a sweep: ``path`` (``--data``: an .npz or a folder), or with no path
    the built-in digits-5 data as ``digits5`` says."""

    path: Path | None
    digits5: Digits5Options | None  # None with a path
    image_size: int  # the side --data folder images are resized to

    def with_split(self, split: str) -> DataOptions:
        """The same data in another digits-5 setting (a sweep over several)."""
        assert self.digits5 is not None
        return replace(self, digits5=replace(self.digits5, split=split))

    def planned_clients(self, seed: int) -> tuple[list[str], tuple[str, ...]] | None:
        """The client names and class list :meth:`partition` will give, without making the
        clients' data; None for --data, whose classes only its files say."""
        if self.digits5 is None:
            return None
        return digits5_clients(seed=seed, **asdict(self.digits5)), DIGIT_CLASSES

    def partition(self, seed: int) -> Partition:
        if self.digits5 is not None:
            return digits5(seed=seed, **asdict(self.digits5))
        assert self.path is not None
        if not self.path.exists():
            raise UsageError(f"--data {self.path} does not exist")
        if self.path.suffix == ".npz":
            return from_npz(self.path)
        return from_directory(self.path, image_size=self.image_size, seed=seed)


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    """The options every sweep shares, resolved: each run of the sweep is
    :meth:`spec` of them."""

    data: DataOptions
    rounds: int
    epochs: int
    out_dim: int
    protocol: str
    train_param: Mapping[str, Any]  # --train-param, over the protocol's [train] settings
    downlink_budget: int
    stats_dim: int
    stats_basis: bool  # --stats-basis: the bundle's public basis (basis.npy)
    bundle: Path
    backbone: str  # what a missing bundle is built as
    zoo_size: str
    transport: str
    broker: str | None
    workers: int
    coordinator_workers: int | None  # None: the single coordinator
    # --secure-aggregation: the fleets' statistics summed securely; ``sum_release`` is the
    # formal release its noise makes ({} without --epsilon: the exact sum).
    secure_aggregation: bool
    sum_release: Mapping[str, Any]
    out: Path  # the sweep's report folder
    progress: bool
    resume: bool
    #: The command line as the report records it: every parsed option in the parser's
    #: order, as resolved, paths as text.
    config: Mapping[str, Any]

    def spec(
        self,
        *,
        method: str,
        seed: int,
        out: Path,
        extra_train: Mapping[str, Any] | None = None,
        privacy: Mapping[str, Any] | None = None,
        reproducible_noise: bool = False,
        plain: bool = False,
    ) -> RunSpec:
        """One run of the sweep, into ``out``. Every run of a sweep shares one feature
        cache under ``--out``: the backbones see each image once, whatever the method. The
        [train] table layers, each over the one before: what ``--protocol`` gives the
        method (:mod:`fleet.transports.protocols`), ``--train-param``, and the sweep's own
        settings (``extra_train``: DP-SGD's GroupNorm, the ceiling's classifier). Under
        --secure-aggregation every run sums securely, with the sweep's noise, unless
        ``plain`` (the ceiling, which pools the data instead of federating it)."""
        base = protocol_train(self.protocol, method)
        secure = self.secure_aggregation and not plain
        if secure and privacy is None:
            privacy = self.sum_release
        return RunSpec(
            method=method,
            rounds=self.rounds,
            bundle=self.bundle,
            out=out,
            seed=seed,
            transport=self.transport,
            broker=self.broker,
            workers=self.workers,
            coordinator_workers=self.coordinator_workers,
            out_dim=self.out_dim,
            epochs=self.epochs,
            downlink_budget=self.downlink_budget,
            stats_dim=self.stats_dim,
            stats_basis=str(self.bundle / BASIS_FILE) if self.stats_basis else "",
            progress=self.progress,
            feature_cache=self.out / "feature-cache",
            extra_train={**base, **self.train_param, **(extra_train or {})},
            privacy=dict(privacy or {}),
            reproducible_noise=reproducible_noise,
            secure_aggregation=secure,
        )


def sweep_options(
    args: argparse.Namespace,
    *,
    method: str,
    split: str | None = None,
    swept_splits: Sequence[str] = (),
) -> SweepOptions:
    """The shared options of ``args``, checked (bundle, data, output folder, transport,
    broker URL, coordinator workers, every run setting) before the zoo is built.
    ``method`` is the sweep's first; ``split`` and ``swept_splits`` are the digits-5
    settings of a sweep over several (``privacy``), in place of ``--split``."""
    backbone = args.backbone or "zoo"
    bundle = resolve_bundle(args.bundle, backbone=args.backbone)
    data = resolve_data(args, split=split, swept_splits=swept_splits)
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
        refuse_vector(method, resume=args.resume)
    workers = 2 if args.workers is None else args.workers
    if args.broker:
        parse_broker_url(args.broker)
    secure = bool(getattr(args, "secure_aggregation", False))
    resolved = {"bundle": bundle, "image_size": data.image_size, "workers": workers}
    if data.digits5 is not None:
        resolved |= asdict(data.digits5)
    options = SweepOptions(
        data=data,
        rounds=args.rounds,
        epochs=args.epochs,
        out_dim=args.out_dim,
        protocol=args.protocol,
        train_param=dict(args.train_param),
        downlink_budget=args.downlink_budget,
        stats_dim=args.stats_dim,
        stats_basis=args.stats_basis,
        bundle=bundle,
        backbone=backbone,
        zoo_size=args.zoo_size,
        transport=args.transport,
        broker=args.broker,
        workers=workers,
        # `privacy` has no such option: its sweep always runs solo, which no worker tier
        # can serve.
        coordinator_workers=getattr(args, "coordinator_workers", None),
        secure_aggregation=secure,
        sum_release=sum_release(args, secure=secure),
        out=args.out,
        progress=not args.no_progress,
        resume=args.resume,
        config=_config(args, resolved),
    )
    check_method(options, method)
    return options


def sum_release(args: argparse.Namespace, *, secure: bool) -> dict[str, Any]:
    """The formal release whose budget the secure sum's noise spends: dp-features at
    ``--epsilon`` and ``--delta``, which --secure-aggregation moves from each device into
    the sum (RunSpec.secure_aggregation); {} without ``--epsilon``, the exact sum."""
    epsilon = getattr(args, "epsilon", None)
    if epsilon is None:
        return {}
    if not secure:
        raise UsageError(
            "--epsilon is the noise of --secure-aggregation's sum; each device's own "
            "mechanisms are swept by edge-fleet privacy"
        )
    if not epsilon > 0:
        raise UsageError(f"--epsilon must be positive (leave it out for no noise), got {epsilon}")
    if not 0 < args.delta < 1:
        raise UsageError(f"--delta must be in (0, 1), got {args.delta}")
    return {"mechanism": "dp-features", "epsilon": epsilon, "delta": args.delta}


def check_method(options: SweepOptions, method: str) -> None:
    """What ``method``'s runs would refuse, refused before anything starts: its run
    settings (RunSpec: --secure-aggregation's refusal too), and over
    ``--coordinator-workers`` the round owner's and the broker's."""
    options.spec(method=method, seed=0, out=options.out)
    refuse_sharded(options, method)


def _config(args: argparse.Namespace, resolved: Mapping[str, Any]) -> dict[str, Any]:
    values = {k: resolved.get(k, v) for k, v in vars(args).items() if k not in _NOT_REPORTED}
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


def refuse_sharded(options: SweepOptions, method: str) -> None:
    """What the round owner (its one line) or the broker would refuse of ``method`` over
    ``--coordinator-workers``, refused before anything starts."""
    if options.coordinator_workers is None:
        return
    spec = options.spec(method=method, seed=0, out=options.out)
    for problem in (planned_workers_refusal(spec), broker_refusal(spec)):
        if problem is not None:
            raise UsageError(problem)


def refuse_vector(method: str, *, resume: bool) -> None:
    """What the vector engine does not implement, refused before anything starts."""
    refusal = vector_refusal(method)
    if refusal is not None:
        raise UsageError(refusal)
    if resume:
        raise UsageError(
            "--resume needs --transport memory or mqtt: the vector engine keeps no "
            "per-device state to resume from"
        )


def resolve_data(
    args: argparse.Namespace, *, split: str | None = None, swept_splits: Sequence[str] = ()
) -> DataOptions:
    """The digits-5 options with their defaults filled in, or, with --data, refused if any
    was given: the clients of an .npz or a folder are what they hold, and a --clients 20
    that quietly ran the file's 5 would mislead."""
    defaults: dict[str, Any] = args.digits5_defaults
    values = {name: getattr(args, name) for name in defaults}
    if split is not None:
        values["split"] = split
    given = [f"--{name}" for name, value in values.items() if value is not None]
    path: Path | None = args.data
    folders = path is not None and path.is_dir()
    if args.image_size is not None and not folders:
        raise UsageError("--image-size applies to --data image folders only")
    # The backbones' input side: no detail lost before they resize.
    image_size = args.image_size
    if image_size is None:
        image_size = 224 if args.backbone == "effnet-lite0" else 32
    if image_size < 1:
        raise UsageError(f"--image-size must be positive, got {image_size}")
    if path is not None:
        if given:
            raise UsageError(
                f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} the built-in "
                f"digits-5 data and do{'es' if len(given) == 1 else ''} not apply to "
                f"--data: its clients are those {path} holds"
            )
        return DataOptions(path=path, digits5=None, image_size=image_size)
    values = {name: defaults[name] if value is None else value for name, value in values.items()}
    # An option no chosen split reads would be dropped without a word.
    splits = list(swept_splits) or [values["split"]]
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
    return DataOptions(path=None, digits5=Digits5Options(**values), image_size=image_size)


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
