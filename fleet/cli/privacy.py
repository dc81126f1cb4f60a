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

Mechanism noise is secret (drawn from the OS) as on a device, so two sweeps with the same
seeds differ in their noise; --reproducible-noise replays it from the seeds instead and
marks every arm `guarantee: none (reproducible noise)`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from edge_agent.privacy.accounting import Plan, plan, plan_features
from edge_agent.privacy.randomness import guarantee
from fleet.cli import commands, options
from fleet.cli.resume import run_or_resume, sweep_dir
from fleet.data.bundles import ensure_bundle
from fleet.data.partition import SPLITS, Partition
from fleet.report.summary import arm_settings, protocol_line, run_summary, settings, to_json
from fleet.transports.runner import run as run_fleet
from runtime.cliutil import UsageError

PAPER_DEFAULT = "gaussian:0.05:0.1,gaussian:0.05:0.2,laplace:0.05:0.1,laplace:0.05:0.2"
FORMAL = ("dp", "dp-features")


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
    options.add_common_options(parser, rounds=20, clients=5, out="runs/privacy", one_split=False)
    parser.set_defaults(transport="memory")


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


def _plan(mechanism: str, epsilon: float, args: argparse.Namespace, *, dataset_size: int) -> Plan:
    """The noise multipliers that spend ``epsilon`` over the sweep's rounds (dp), or over
    one release (dp-features: the simulated devices' data never changes)."""
    try:
        if mechanism == "dp-features":
            return plan_features(epsilon_target=epsilon, delta=args.delta, releases=1)
        return plan(epsilon_target=epsilon, delta=args.delta, rounds=args.rounds,
                    epochs=args.epochs, dataset_size=dataset_size, batch=32,
                    release_share=args.release_share)  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"no {mechanism} plan for epsilon {epsilon:g}: {exc}") from exc


def _privacy_table(mechanism: str, epsilon: float, chosen: Plan, args: argparse.Namespace,
                   dataset_size: int) -> dict[str, Any]:  # fmt: skip
    """The agents' [privacy] table of one arm."""
    table: dict[str, Any] = {"mechanism": mechanism, "epsilon": epsilon, "delta": args.delta,
                             "release_noise_multiplier": chosen.release_noise_multiplier}  # fmt: skip
    if mechanism == "dp":
        table |= {"sgd_noise_multiplier": chosen.sgd_noise_multiplier, "dataset_size": dataset_size}
    return table


def _dataset_size(args: argparse.Namespace, partition: Partition) -> int:
    """The declared bound: --dataset-size, else the largest client's training set."""
    largest = max(len(c.train_y) for c in partition.clients)
    if args.dataset_size is None:
        return largest
    if args.dataset_size < largest:
        raise UsageError(
            f"--dataset-size {args.dataset_size} is below the largest client's "
            f"{largest} training samples: it must bound every device's data"
        )
    return int(args.dataset_size)


def main(args: argparse.Namespace) -> int:
    if args.split is not None:  # it would be overwritten by each of --splits in turn
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
        args.split, args.swept_splits = splits[0], splits
    paper = _paper_settings(args.paper)
    mechanisms = options.split_list(args.mechanisms, what="mechanisms", allowed=FORMAL)
    seeds = options.parse_seeds(args.seeds)
    first = commands.check_options(args, method="fedpcl", seed=seeds[0])
    size = _dataset_size(args, first)
    for mechanism in mechanisms:  # an impossible plan fails now, not after the zoo is built
        for eps in epsilons:
            _plan(mechanism, eps, args, dataset_size=size)
    with commands.hold_output_folder(args.out):
        return _sweep(args, splits, seeds, epsilons, paper, mechanisms, first)


def _sweep(
    args: argparse.Namespace,
    splits: list[str],
    seeds: list[int],
    epsilons: list[float],
    paper: list[tuple[str, float, float]],
    mechanisms: list[str],
    first: Partition,
) -> int:
    bundle = ensure_bundle(args.bundle, args.zoo_size, backbone=args.backbone or "zoo")
    sweep = sweep_dir(args.out, resume=args.resume)
    results: dict[str, Any] = {}
    attacks: dict[str, Any] = {}
    arm_train: dict[str, dict[str, Any]] = {}  # each arm's [train] settings beyond defaults
    arm_full: dict[str, dict[str, Any]] = {}  # and everything that shaped it, in full
    arm_privacy: dict[str, dict[str, Any]] = {}  # each arm's [privacy] table and guarantee
    for split in splits:
        if args.data is None:
            args.split = split
        rows: dict[str, list[float]] = {}
        for seed in seeds:
            first_run = split == splits[0] and seed == seeds[0]
            partition = first if first_run else commands.partition_for(args, seed)
            size = _dataset_size(args, partition)
            arms: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
                ("solo (no privacy)", "solo", {}, {}),
                ("fedpcl (no privacy)", "fedpcl", {}, {}),
            ]
            for noise, scale, p in paper:
                arms.append((f"fedpcl paper {noise} s={scale} p={p}", "fedpcl",
                             {"mechanism": "paper", "paper_noise": noise,
                              "paper_scale": scale, "paper_p": p}, {}))  # fmt: skip
            for mechanism in mechanisms:
                for eps in epsilons:
                    chosen = _plan(mechanism, eps, args, dataset_size=size)
                    arms.append((f"fedpcl {mechanism} eps={eps:g}", "fedpcl",
                                 _privacy_table(mechanism, eps, chosen, args, size),
                                 {"norm": "group"} if mechanism == "dp" else {}))  # fmt: skip
            for name, method, privacy, train in arms:
                slug = name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")
                spec = commands.spec_for(
                    args, method=method, bundle=bundle, seed=seed,
                    out=sweep / split / f"{slug}-seed{seed}",
                    extra_train=train, privacy=privacy,
                    reproducible_noise=args.reproducible_noise,
                )  # fmt: skip
                result, _ = run_or_resume(spec, partition, run=run_fleet)
                arm_train.setdefault(name, dict(spec.extra_train))
                arm_full.setdefault(name, arm_settings(spec, protocol=args.protocol))
                formal = privacy.get("mechanism") in FORMAL
                arm_privacy.setdefault(name, {**privacy, "guarantee": guarantee(
                    formal=formal, reproducible=args.reproducible_noise)})  # fmt: skip
                final = run_summary(result)["final_mean"]
                rows.setdefault(name, []).append(final)
                print(
                    f"{split:>13} seed {seed}: {name:<34} {final:.3f}", file=sys.stderr, flush=True
                )
        results[split] = {name: sum(v) / len(v) for name, v in rows.items()}
        attacks[split] = label_attack(partition, epsilons, mechanisms, args)
    document = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                           if k not in ("command", "log_format", "log_level")},
                "epsilons": epsilons, "delta": args.delta, "mechanisms": mechanisms,
                "results": results, "train": arm_train, "settings": arm_full,
                "privacy": arm_privacy,
                "label_inference_tv": attacks}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(to_json(document))
    table = markdown(document)
    (args.out / "report.md").write_text(table)
    plot = plot_accuracy_vs_epsilon(document, args.out / "accuracy_vs_epsilon.png")
    print(table)
    print(f"report.json: {args.out / 'report.json'}\nplot: {plot}")
    return 0


def label_attack(
    partition: Any, epsilons: list[float], mechanisms: list[str], args: argparse.Namespace
) -> dict[str, float]:
    """Mean total variation distance between each client's label distribution and what an
    observer reads off its released counts: exact counts (no noise) and each formal
    mechanism's release at each epsilon (the multipliers the sweep used; 200 draws per
    client). dp releases counts every round (one round's are read here); dp-features once."""
    import numpy as np

    from edge_agent.privacy.mechanisms import MechanismParams, release_dp
    from fleet.report.privacy_audit import label_inference_error

    rng = np.random.default_rng(0)
    num_classes = len(partition.classes)
    out: dict[str, float] = {}
    true = [np.bincount(c.train_y, minlength=num_classes) for c in partition.clients]
    out["no noise"] = float(np.mean([label_inference_error(t, t) for t in true]))
    size = _dataset_size(args, partition)
    for mechanism in mechanisms:
        for eps in epsilons:
            sigma = _plan(mechanism, eps, args, dataset_size=size).release_sum_sigma
            params = MechanismParams(sum_sigma=sigma, count_sigma=sigma)
            errors = []
            for c, t in zip(partition.clients, true, strict=True):
                z = np.zeros((len(c.train_y), 2))
                z[:, 0] = 1.0  # counts do not depend on the embeddings
                errors += [label_inference_error(t, release_dp(z, c.train_y, num_classes, params, rng).counts)
                           for _ in range(200)]  # fmt: skip
            out[f"{mechanism} eps={eps:g}"] = float(np.mean(errors))
    return out


def _label(split: str, document: dict[str, Any]) -> str:
    """A column's name: a digits-5 setting ('feature shift') or the --data file's name."""
    return split if document.get("config", {}).get("data") else f"{split} shift"


def markdown(document: dict[str, Any]) -> str:
    splits = list(document["results"])
    names = list(next(iter(document["results"].values())))
    config = document.get("config", {})
    data = Path(config.get("data") or "digits-5").name
    protocol = f"; {config['protocol']} protocol" if config.get("protocol") else ""
    lines = [
        f"# Privacy on {data} (delta {document['delta']:g} for the whole run{protocol})",
        "",
        *([line, ""] if (line := protocol_line(config)) else []),
        "Final mean test accuracy (%) over the clients.",
        *_guarantee_lines(document),
        *([f"Settings: {line}."] if (line := settings(document.get("config", {}))) else []),
        "",
        "| setting | " + " | ".join(_label(s, document) for s in splits) + " |",
        "|---|" + "---:|" * len(splits),
    ]
    for name in names:
        cells = [f"{100 * document['results'][s][name]:.1f}" for s in splits]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    attacks = document.get("label_inference_tv", {})
    if attacks:
        lines += ["", "Label-distribution inference from one round's released counts: mean "
                  "total variation distance to the truth (0 = given away exactly).", "",
                  "| release | " + " | ".join(_label(s, document) for s in attacks) + " |",
                  "|---|" + "---:|" * len(attacks)]  # fmt: skip
        for name in next(iter(attacks.values())):
            lines.append(
                f"| {name} | " + " | ".join(f"{attacks[s][name]:.3f}" for s in attacks) + " |"
            )
    return "\n".join(lines) + "\n"


def _guarantee_lines(document: dict[str, Any]) -> list[str]:
    """What each formal arm's epsilon is worth, said once for the table."""
    claims = {v.get("guarantee") for k, v in document.get("privacy", {}).items()
              if v.get("mechanism") in FORMAL}  # fmt: skip
    return [f"Formal arms' guarantee: {c}." for c in sorted(c for c in claims if c)]


LINE_STYLES = {"dp": ("o", "-"), "dp-features": ("s", "-.")}
LABELS = {"dp": "DP FedPCL (DP-SGD)", "dp-features": "FedPCL, dp-features release"}


def plot_accuracy_vs_epsilon(document: dict[str, Any], path: Path) -> Path:
    from fleet.report.plots import finish, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    epsilons = document["epsilons"]
    for i, (split, rows) in enumerate(document["results"].items()):
        colour = f"C{i}"
        for mechanism in document.get("mechanisms", ["dp"]):
            marker, style = LINE_STYLES[mechanism]
            ys = [100 * rows[f"fedpcl {mechanism} eps={e:g}"] for e in epsilons]
            ax.plot(epsilons, ys, marker=marker, linestyle=style, color=colour,
                    label=f"{LABELS[mechanism]}, {_label(split, document)}")  # fmt: skip
        ax.axhline(100 * rows["fedpcl (no privacy)"], color=colour, linestyle=":",
                   label=f"FedPCL without privacy, {split}")  # fmt: skip
        ax.axhline(100 * rows["solo (no privacy)"], color=colour, linestyle="--",
                   label=f"Solo (shares nothing), {split}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    ax.set_xlabel(f"epsilon (delta {document['delta']:g}, whole run)")
    ax.set_ylabel("final mean test accuracy (%)")
    ax.set_ylim(0, 100)
    return finish(plt, fig, ax, path, legend_size=7)
