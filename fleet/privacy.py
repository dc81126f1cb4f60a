"""``edge-fleet privacy``: what privacy costs in accuracy, on digits-5.

For each split: FedPCL with the `dp` mechanism at each epsilon (the whole run, at delta;
noise multipliers from the same planner as ``edge-agent privacy-plan``), FedPCL with the
`paper` noise settings (FedPCL A.2.4), FedPCL without privacy, and non-private Solo,
which is what a device keeps by not federating at all. Also an attack: how well an
observer infers each client's label distribution from its released counts, without noise
and under each epsilon's release noise. Writes report.json, report.md and
accuracy_vs_epsilon.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from edge_agent.privacy.accounting import plan
from fleet import commands
from fleet.partition import Partition
from fleet.report import arm_settings, protocol_line, run_summary, settings, to_json
from fleet.resume import run_or_resume, sweep_dir
from fleet.runner import run as run_fleet
from protocol.cliutil import UsageError

PAPER_DEFAULT = "gaussian:0.05:0.1,gaussian:0.05:0.2,laplace:0.05:0.1,laplace:0.05:0.2"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "privacy",
        help="accuracy vs epsilon of DP FedPCL, the paper's noise, and non-private Solo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--epsilons", default="1,2,4,8,16", help="DP budgets (default 1,2,4,8,16)")
    parser.add_argument("--delta", type=float, default=1e-5, help="default 1e-5")
    parser.add_argument("--splits", help="digits-5 settings (default feature,label)")
    parser.add_argument(
        "--paper",
        default=PAPER_DEFAULT,
        help=f"noise:scale:p settings of the paper's mechanism (default {PAPER_DEFAULT})",
    )
    parser.add_argument("--seeds", default="0", help="comma-separated (default 0)")
    parser.add_argument("--release-share", type=float, default=0.2,
                        help="share of each budget spent by the releases (default 0.2)")  # fmt: skip
    commands.add_common_options(parser, rounds=20, clients=5, out="runs/privacy", one_split=False)
    parser.set_defaults(transport="memory")


def _paper_settings(text: str) -> list[tuple[str, float, float]]:
    out = []
    for item in commands.split_list(text, what="paper"):
        try:
            noise, scale, p = item.split(":")
            out.append((noise, float(scale), float(p)))
        except ValueError as exc:
            raise UsageError(f"--paper items look like gaussian:0.05:0.1, got {item!r}") from exc
        if noise not in ("gaussian", "laplace"):
            raise UsageError(f"--paper noise must be gaussian or laplace, got {noise!r}")
    return out


def _plan(epsilon: float, args: argparse.Namespace, *, samples: int) -> Any:
    """The noise multipliers that spend ``epsilon`` over the sweep's rounds."""
    try:
        return plan(epsilon_target=epsilon, delta=args.delta, rounds=args.rounds,
                    epochs=args.epochs, samples=samples, batch=32,
                    release_share=args.release_share)  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"no privacy plan for epsilon {epsilon:g}: {exc}") from exc


def main(args: argparse.Namespace) -> int:
    if args.split is not None:  # it would be overwritten by each of --splits in turn
        raise UsageError(
            "privacy runs every setting in --splits (default feature,label), not --split: "
            f"for this one alone give --splits {args.split}"
        )
    try:
        epsilons = [float(e) for e in commands.split_list(args.epsilons, what="epsilons")]
    except ValueError as exc:
        raise UsageError(f"--epsilons must be numbers: {exc}") from exc
    if args.data is not None:
        if args.splits is not None:
            raise UsageError("--splits chooses digits-5 settings and does not apply to --data")
        splits = [args.data.name]  # one "setting": the clients the data holds
    else:
        splits = commands.split_list(
            args.splits or "feature,label", what="splits", allowed=commands.SPLITS
        )
        args.split, args.swept_splits = splits[0], splits
    paper = _paper_settings(args.paper)
    seeds = commands.parse_seeds(args.seeds)
    first = commands.check_options(args, method="fedpcl", seed=seeds[0])
    for eps in epsilons:  # an impossible privacy plan fails now, not after the zoo is built
        _plan(eps, args, samples=min(len(c.train_y) for c in first.clients))
    with commands.hold_output_folder(args.out):
        return _sweep(args, splits, seeds, epsilons, paper, first)


def _sweep(
    args: argparse.Namespace,
    splits: list[str],
    seeds: list[int],
    epsilons: list[float],
    paper: list[tuple[str, float, float]],
    first: Partition,
) -> int:
    bundle = commands.ensure_bundle(args.bundle, args.zoo_size)
    sweep = sweep_dir(args.out, resume=args.resume)
    results: dict[str, Any] = {}
    attacks: dict[str, Any] = {}
    arm_train: dict[str, dict[str, Any]] = {}  # each arm's [train] settings beyond defaults
    arm_full: dict[str, dict[str, Any]] = {}  # and everything that shaped it, in full
    for split in splits:
        if args.data is None:
            args.split = split
        rows: dict[str, list[float]] = {}
        for seed in seeds:
            first_run = split == splits[0] and seed == seeds[0]
            partition = first if first_run else commands.partition_for(args, seed)
            samples = min(len(c.train_y) for c in partition.clients)
            arms: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
                ("solo (no privacy)", "solo", {}, {}),
                ("fedpcl (no privacy)", "fedpcl", {}, {}),
            ]
            for noise, scale, p in paper:
                arms.append((f"fedpcl paper {noise} s={scale} p={p}", "fedpcl",
                             {"mechanism": "paper", "paper_noise": noise,
                              "paper_scale": scale, "paper_p": p}, {}))  # fmt: skip
            for eps in epsilons:
                chosen = _plan(eps, args, samples=samples)
                arms.append((f"fedpcl dp eps={eps:g}", "fedpcl",
                             {"mechanism": "dp", "epsilon": eps, "delta": args.delta,
                              "sgd_noise_multiplier": chosen.sgd_noise_multiplier,
                              "release_noise_multiplier": chosen.release_noise_multiplier},
                             {"norm": "group"}))  # fmt: skip
            for name, method, privacy, train in arms:
                slug = name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")
                spec = commands.spec_for(
                    args, method=method, bundle=bundle, seed=seed,
                    out=sweep / split / f"{slug}-seed{seed}",
                    extra_train=train, privacy=privacy,
                )  # fmt: skip
                result, _ = run_or_resume(spec, partition, run=run_fleet)
                arm_train.setdefault(name, dict(spec.extra_train))
                arm_full.setdefault(name, arm_settings(spec, protocol=args.protocol))
                final = run_summary(result)["final_mean"]
                rows.setdefault(name, []).append(final)
                print(
                    f"{split:>13} seed {seed}: {name:<34} {final:.3f}", file=sys.stderr, flush=True
                )
        results[split] = {name: sum(v) / len(v) for name, v in rows.items()}
        attacks[split] = label_attack(partition, epsilons, args)
    document = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                           if k not in ("command", "log_format", "log_level")},
                "epsilons": epsilons, "delta": args.delta, "results": results, "train": arm_train,
                "settings": arm_full,
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
    partition: Any, epsilons: list[float], args: argparse.Namespace
) -> dict[str, float]:
    """Mean total variation distance between each client's label distribution and what an
    observer reads off its released counts: exact counts (no noise) and the dp release at
    each epsilon (the multipliers the sweep used; 200 draws per client)."""
    import numpy as np

    from edge_agent.privacy.audit import label_inference_error
    from edge_agent.privacy.mechanisms import MechanismParams, release_dp

    rng = np.random.default_rng(0)
    num_classes = len(partition.classes)
    out: dict[str, float] = {}
    true = [np.bincount(c.train_y, minlength=num_classes) for c in partition.clients]
    out["no noise"] = float(np.mean([label_inference_error(t, t) for t in true]))
    samples = min(len(c.train_y) for c in partition.clients)
    for eps in epsilons:
        chosen = plan(epsilon_target=eps, delta=args.delta, rounds=args.rounds, epochs=args.epochs,
                      samples=samples, batch=32, release_share=args.release_share)  # fmt: skip
        sigma = chosen.release_sum_sigma
        params = MechanismParams(sum_sigma=sigma, count_sigma=sigma)
        errors = []
        for c, t in zip(partition.clients, true, strict=True):
            z = np.zeros((len(c.train_y), 2))
            z[:, 0] = 1.0  # counts do not depend on the embeddings
            errors += [label_inference_error(t, release_dp(z, c.train_y, num_classes, params, rng).counts)
                       for _ in range(200)]  # fmt: skip
        out[f"dp eps={eps:g}"] = float(np.mean(errors))
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


def plot_accuracy_vs_epsilon(document: dict[str, Any], path: Path) -> Path:
    from fleet.report import finish, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    epsilons = document["epsilons"]
    for i, (split, rows) in enumerate(document["results"].items()):
        colour = f"C{i}"
        ys = [100 * rows[f"fedpcl dp eps={e:g}"] for e in epsilons]
        ax.plot(
            epsilons, ys, marker="o", color=colour, label=f"DP FedPCL, {_label(split, document)}"
        )
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
