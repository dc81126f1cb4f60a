"""``edge-fleet privacy``: what privacy costs in accuracy, on digits-5.

For each split: FedPCL with each formal mechanism at each epsilon (the whole run, at
delta; noise multipliers from the same planner as ``edge-agent privacy-plan``, from
public settings only): `dp` (DP-SGD on the head and a Gaussian release of its prototypes
every round) and `dp-features` (one Gaussian release of the frozen backbone features; the
head trains without noise); FedPCL with the `paper` noise settings (FedPCL A.2.4),
FedPCL without privacy, and non-private Solo, which is what a device keeps by not
federating at all. Also an attack: how well an observer infers each client's label
distribution from its released counts, without noise and under each epsilon's release
noise. Writes report.json, report.md and accuracy_vs_epsilon.png.

With --closed-form (lda by default, or ridge), on the vector transport: the method with
each device's own `dp-features` statistics release (local noise) against the fleet's
secure sum carrying the distributed discrete Gaussian (`--secure-aggregation`: only the
sum reaches the coordinator, its noise spends the same epsilon once) at each epsilon,
and the exact sum as reference.

Mechanism noise is secret (drawn from the OS) as on a device, so two sweeps with the same
seeds differ in their noise; --reproducible-noise replays it from the seeds instead and
marks every arm `guarantee: none (reproducible noise)`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.privacy.accounting import Plan, plan, plan_features
from edge_agent.privacy.mechanisms import MechanismParams, release_dp
from edge_agent.privacy.randomness import guarantee
from fleet.cli import commands, options, parsers
from fleet.cli.resume import run_or_resume, sweep_dir
from fleet.data.bundles import ensure_basis, ensure_bundle
from fleet.data.partition import SPLITS, Partition
from fleet.report.privacy_audit import label_inference_error
from fleet.report.privacy_report import FORMAL, markdown, plot_accuracy_vs_epsilon
from fleet.report.summary import agent_privacy, arm_settings, run_summary, to_json
from fleet.transports.runner import run as run_fleet
from fleet.transports.spec import RunSpec
from protocol.methods import WIRE_METHODS
from runtime.cliutil import UsageError

#: The closed-form methods --closed-form compares local and distributed noise for: those
#: a secure sum serves (protocol/methods.py).
CLOSED_FORM = tuple(m.name for m in WIRE_METHODS.values() if m.closed_form and m.secure)

PAPER_DEFAULT = "gaussian:0.05:0.1,gaussian:0.05:0.2,laplace:0.05:0.1,laplace:0.05:0.2"

#: The transports the Solo and FedPCL arms run over. Every sweep has FedPCL arms with a
#: privacy mechanism (--mechanisms is never empty), which the vector transport does not
#: train; the closed-form arms run on the vector transport whatever --transport says.
ARM_TRANSPORTS = ("memory", "mqtt")
TRANSPORT_HELP = (
    "what the Solo and FedPCL arms run over: memory (one process, no broker) or mqtt "
    "(broker + processes); the vector transport trains FedPCL without a privacy mechanism "
    "only, so it is refused. The --closed-form arms always run on the vector transport "
    "(default memory)"
)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "privacy",
        help="accuracy vs epsilon of DP FedPCL, the paper's noise, and non-private Solo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--epsilons", default="1,2,4,8,16", help="DP budgets (default 1,2,4,8,16)")
    parser.add_argument("--delta", type=float, default=1e-5, help="default 1e-5")
    parser.add_argument("--mechanisms", default=",".join(FORMAL),
                        help=f"formal mechanisms to sweep (default {','.join(FORMAL)})")  # fmt: skip
    parser.add_argument("--dataset-size", type=int,
                        help="dp: the public bound on a device's training samples that DP-SGD "
                             "is planned from (default: the largest client's)")  # fmt: skip
    parser.add_argument("--reproducible-noise", action="store_true",
                        help="replay mechanism noise from the seeds (voids every guarantee)")  # fmt: skip
    parser.add_argument("--splits", help="digits-5 settings (default feature,label)")
    parser.add_argument(
        "--paper",
        default=PAPER_DEFAULT,
        help=f"noise:scale:p settings of the paper's mechanism, or none (default {PAPER_DEFAULT})",
    )
    parser.add_argument("--seeds", default="0", help="comma-separated (default 0)")
    parser.add_argument("--release-share", type=float, default=0.2,
                        help="share of each budget spent by the releases (default 0.2)")  # fmt: skip
    parser.add_argument("--closed-form", nargs="?", const="lda", choices=CLOSED_FORM,
                        help="also sweep this closed-form method (lda when named alone) on the "
                             "vector transport: each device's dp-features release against the "
                             "secure sum's distributed noise at each epsilon, the exact sum as "
                             "reference (default: not swept)")  # fmt: skip
    parsers.add_common_options(parser, rounds=20, clients=5, out="runs/privacy", one_split=False,
                               transport_help=TRANSPORT_HELP)  # fmt: skip
    parser.set_defaults(transport="memory")


@dataclass(frozen=True, kw_only=True)
class PrivacyOptions:
    """What a privacy sweep was asked, resolved: the arms' settings beside the options
    every sweep shares."""

    sweep: options.SweepOptions
    splits: tuple[str, ...]  # digits-5 settings, or the --data file's name alone
    epsilons: tuple[float, ...]
    delta: float
    mechanisms: tuple[str, ...]
    paper: tuple[tuple[str, float, float], ...]  # (noise, scale, p) of each paper arm
    seeds: tuple[int, ...]
    dataset_size: int | None  # --dataset-size: the declared bound, if given
    release_share: float
    reproducible_noise: bool
    closed_form: str | None = None  # --closed-form: the method, or None

    def config(self) -> dict[str, Any]:
        """The command line as the report records it."""
        if self.sweep.data.digits5 is None:
            return dict(self.sweep.config)
        # As the report has always had it: the last setting swept, then all of them.
        return {**self.sweep.config, "split": self.splits[-1], "swept_splits": list(self.splits)}


def _paper_settings(text: str) -> list[tuple[str, float, float]]:
    out: list[tuple[str, float, float]] = []
    if text.strip() == "none":
        return out
    for item in options.split_list(text, what="paper"):
        try:
            noise, scale, p = item.split(":")
            out.append((noise, float(scale), float(p)))
        except ValueError as exc:
            raise UsageError(f"--paper items look like gaussian:0.05:0.1, got {item!r}") from exc
        if noise not in ("gaussian", "laplace"):
            raise UsageError(f"--paper noise must be gaussian or laplace, got {noise!r}")
    return out


def _plan(mechanism: str, epsilon: float, opts: PrivacyOptions, *, dataset_size: int) -> Plan:
    """The noise multipliers that spend ``epsilon`` over the sweep's rounds (dp), or over
    one release (dp-features: the simulated devices' data never changes)."""
    try:
        if mechanism == "dp-features":
            return plan_features(epsilon_target=epsilon, delta=opts.delta, releases=1)
        return plan(epsilon_target=epsilon, delta=opts.delta, rounds=opts.sweep.rounds,
                    epochs=opts.sweep.epochs, dataset_size=dataset_size, batch=32,
                    release_share=opts.release_share)  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"no {mechanism} plan for epsilon {epsilon:g}: {exc}") from exc


def _privacy_table(mechanism: str, epsilon: float, chosen: Plan, opts: PrivacyOptions,
                   dataset_size: int) -> dict[str, Any]:  # fmt: skip
    """The agents' [privacy] table of one arm."""
    table: dict[str, Any] = {"mechanism": mechanism, "epsilon": epsilon, "delta": opts.delta,
                             "release_noise_multiplier": chosen.release_noise_multiplier}  # fmt: skip
    if mechanism == "dp":
        table |= {"sgd_noise_multiplier": chosen.sgd_noise_multiplier, "dataset_size": dataset_size}
    return table


def _dataset_size(opts: PrivacyOptions, partition: Partition) -> int:
    """The declared bound: --dataset-size, else the largest client's training set."""
    largest = max(len(c.train_y) for c in partition.clients)
    if opts.dataset_size is None:
        return largest
    if opts.dataset_size < largest:
        raise UsageError(
            f"--dataset-size {opts.dataset_size} is below the largest client's "
            f"{largest} training samples: it must bound every device's data"
        )
    return int(opts.dataset_size)


def privacy_options(args: argparse.Namespace) -> PrivacyOptions:
    """The options of ``args``, checked before the zoo is built."""
    if args.transport not in ARM_TRANSPORTS:
        raise UsageError(
            f"--transport {args.transport}: the sweep's FedPCL arms train with a privacy "
            "mechanism, which that transport does not run; give --transport memory (the "
            "default) or mqtt (the --closed-form arms run on the vector transport either way)"
        )
    if args.split is not None:  # each of --splits in turn would override it
        raise UsageError(
            "privacy runs every setting in --splits (default feature,label), not --split: "
            f"for this one alone give --splits {args.split}"
        )
    try:
        epsilons = [float(e) for e in options.split_list(args.epsilons, what="epsilons")]
    except ValueError as exc:
        raise UsageError(f"--epsilons must be numbers: {exc}") from exc
    if args.data is not None:
        if args.splits is not None:
            raise UsageError("--splits chooses digits-5 settings and does not apply to --data")
        splits = [args.data.name]  # one "setting": the clients the data holds
    else:
        splits = options.split_list(args.splits or "feature,label", what="splits", allowed=SPLITS)
    swept = splits if args.data is None else []  # the digits-5 settings, in place of --split
    paper = _paper_settings(args.paper)
    mechanisms = options.split_list(args.mechanisms, what="mechanisms", allowed=FORMAL)
    seeds = options.parse_seeds(args.seeds)
    return PrivacyOptions(
        sweep=options.sweep_options(
            args, method="fedpcl", split=swept[0] if swept else None, swept_splits=swept
        ),
        splits=tuple(splits),
        epsilons=tuple(epsilons),
        delta=args.delta,
        mechanisms=tuple(mechanisms),
        paper=tuple(paper),
        seeds=tuple(seeds),
        dataset_size=args.dataset_size,
        release_share=args.release_share,
        reproducible_noise=args.reproducible_noise,
        closed_form=args.closed_form,
    )


def main(args: argparse.Namespace) -> int:
    opts = privacy_options(args)
    first = opts.sweep.data.partition(opts.seeds[0])
    size = _dataset_size(opts, first)
    # An impossible plan or arm fails now, not after the zoo is built.
    for arm in _arms(opts, size):
        _spec(arm, opts, seed=opts.seeds[0], out=opts.sweep.out)
    with commands.hold_output_folder(opts.sweep.out):
        return _sweep(opts, first)


@dataclass(frozen=True)
class Arm:
    """One arm of the sweep: its name in the report, its method, the agents' [privacy]
    table and its own [train] settings. A closed-form arm runs on the vector transport,
    with ``secure`` its statistics summed securely (the [privacy] table's release then
    becomes the sum's noise)."""

    name: str
    method: str
    privacy: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    closed_form: bool = False
    secure: bool = False

    @property
    def slug(self) -> str:
        """Its runs' folder name."""
        return self.name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")


def _arms(opts: PrivacyOptions, size: int) -> list[Arm]:
    """Every arm, for a partition whose declared bound is ``size``."""
    arms = [Arm("solo (no privacy)", "solo"), Arm("fedpcl (no privacy)", "fedpcl")]
    for noise, scale, p in opts.paper:
        arms.append(Arm(f"fedpcl paper {noise} s={scale} p={p}", "fedpcl",
                        {"mechanism": "paper", "paper_noise": noise,
                         "paper_scale": scale, "paper_p": p}))  # fmt: skip
    for mechanism in opts.mechanisms:
        for eps in opts.epsilons:
            chosen = _plan(mechanism, eps, opts, dataset_size=size)
            arms.append(Arm(f"fedpcl {mechanism} eps={eps:g}", "fedpcl",
                            _privacy_table(mechanism, eps, chosen, opts, size),
                            {"norm": "group"} if mechanism == "dp" else {}))  # fmt: skip
    method = opts.closed_form
    if method is not None:
        arms.append(Arm(f"{method} exact sum (no privacy)", method, closed_form=True))
        for eps in opts.epsilons:
            local = _privacy_table("dp-features", eps, _plan("dp-features", eps, opts,
                                   dataset_size=size), opts, size)  # fmt: skip
            arms.append(Arm(f"{method} dp-features eps={eps:g}", method, local, closed_form=True))
            # The same budget, spent once by the sum's noise; the declared bound is the
            # quantiser's clip (fleet/transports/secure.py).
            arms.append(Arm(f"{method} secure eps={eps:g}", method,
                            {**local, "dataset_size": size}, closed_form=True,
                            secure=True))  # fmt: skip
    return arms


def _spec(arm: Arm, opts: PrivacyOptions, *, seed: int, out: Path) -> RunSpec:
    """The run of ``arm`` for ``seed``, into ``out`` (checked as it is built)."""
    spec = opts.sweep.spec(
        method=arm.method, seed=seed, out=out, extra_train=arm.train, privacy=arm.privacy,
        reproducible_noise=opts.reproducible_noise,
    )  # fmt: skip
    if arm.closed_form:  # every client of the fleet in this process: no broker, no workers
        spec = replace(spec, transport="vector", broker=None, secure_aggregation=arm.secure)
    return spec


def _sweep(opts: PrivacyOptions, first: Partition) -> int:
    sweep_opts = opts.sweep
    ensure_bundle(sweep_opts.bundle, sweep_opts.zoo_size, backbone=sweep_opts.backbone)
    if sweep_opts.stats_basis:
        ensure_basis(sweep_opts.bundle)
    sweep = sweep_dir(sweep_opts.out, resume=sweep_opts.resume)
    results: dict[str, Any] = {}
    attacks: dict[str, Any] = {}
    arm_train: dict[str, dict[str, Any]] = {}  # each arm's [train] settings beyond defaults
    arm_full: dict[str, dict[str, Any]] = {}  # and everything that shaped it, in full
    arm_privacy: dict[str, dict[str, Any]] = {}  # each arm's [privacy] table and guarantee
    partition = first
    for split in opts.splits:
        data = sweep_opts.data
        if data.digits5 is not None:
            data = data.with_split(split)
        rows: dict[str, list[float]] = {}
        for seed in opts.seeds:
            first_run = split == opts.splits[0] and seed == opts.seeds[0]
            partition = first if first_run else data.partition(seed)
            for arm in _arms(opts, _dataset_size(opts, partition)):
                name = arm.name
                spec = _spec(arm, opts, seed=seed, out=sweep / split / f"{arm.slug}-seed{seed}")
                result, _ = run_or_resume(spec, partition, run=run_fleet)
                arm_train.setdefault(name, dict(spec.extra_train))
                arm_full.setdefault(name, arm_settings(spec, protocol=sweep_opts.protocol,
                                                       secure=result.secure))  # fmt: skip
                # What each arm's release is worth: a device's (its mechanism's), or
                # under secure aggregation the sum's (its noise in place of theirs).
                privacy = dict(arm.privacy)
                formal = privacy.get("mechanism") in FORMAL
                if result.secure is not None:
                    privacy = agent_privacy(spec, result.secure)
                    formal = result.secure.epsilon > 0
                arm_privacy.setdefault(name, {**privacy, "guarantee": guarantee(
                    formal=formal, reproducible=opts.reproducible_noise)})  # fmt: skip
                final = run_summary(result)["final_mean"]
                rows.setdefault(name, []).append(final)
                print(
                    f"{split:>13} seed {seed}: {name:<34} {final:.3f}", file=sys.stderr, flush=True
                )
        results[split] = {name: sum(v) / len(v) for name, v in rows.items()}
        attacks[split] = label_attack(partition, opts)
    document = {"config": opts.config(),
                "epsilons": list(opts.epsilons), "delta": opts.delta,
                "mechanisms": list(opts.mechanisms), "closed_form": opts.closed_form,
                "results": results, "train": arm_train, "settings": arm_full,
                "privacy": arm_privacy,
                "label_inference_tv": attacks}  # fmt: skip
    out = sweep_opts.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(to_json(document))
    table = markdown(document)
    (out / "report.md").write_text(table)
    plot = plot_accuracy_vs_epsilon(document, out / "accuracy_vs_epsilon.png")
    print(table)
    print(f"report.json: {out / 'report.json'}\nplot: {plot}")
    return 0


def label_attack(partition: Partition, opts: PrivacyOptions) -> dict[str, float]:
    """Mean total variation distance between each client's label distribution and what an
    observer reads off its released counts: exact counts (no noise) and each formal
    mechanism's release at each epsilon (the multipliers the sweep used; 200 draws per
    client). dp releases counts every round (one round's are read here); dp-features once."""
    rng = np.random.default_rng(0)
    num_classes = len(partition.classes)
    out: dict[str, float] = {}
    true = [np.bincount(c.train_y, minlength=num_classes) for c in partition.clients]
    out["no noise"] = float(np.mean([label_inference_error(t, t) for t in true]))
    size = _dataset_size(opts, partition)
    for mechanism in opts.mechanisms:
        for eps in opts.epsilons:
            sigma = _plan(mechanism, eps, opts, dataset_size=size).release_sum_sigma
            params = MechanismParams(sum_sigma=sigma, count_sigma=sigma)
            errors = []
            for c, t in zip(partition.clients, true, strict=True):
                z = np.zeros((len(c.train_y), 2))
                z[:, 0] = 1.0  # counts do not depend on the embeddings
                errors += [label_inference_error(t, release_dp(z, c.train_y, num_classes, params, rng).counts)
                           for _ in range(200)]  # fmt: skip
            out[f"{mechanism} eps={eps:g}"] = float(np.mean(errors))
    return out
