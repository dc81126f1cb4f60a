"""Reports of simulated fleets: report.json, a Table-2-shaped report.md, and PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.downlink import DEFAULT_BUDGET
from fleet.transports.spec import RunResult, RunSpec


def _mean(values: Sequence[float | None]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")


def _std(values: Sequence[float | None]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.std(vals)) if vals else float("nan")


def final_accuracy(result: RunResult, rule: str = "accuracy") -> dict[str, float]:
    """Each client's accuracy after the last round it answered; ``rule`` picks the
    method's own inference (``accuracy``), ``accuracy_prototype`` or ``accuracy_classifier``."""
    out = {}
    for c in result.clients:
        answered = [a for a in getattr(c, rule) if a is not None]
        out[c.name] = answered[-1] if answered else float("nan")
    return out


def best_of(curve: Sequence[float | None]) -> tuple[float, int | None]:
    """(best, its round) of a mean-accuracy-by-round curve; rounds counted from 1 (the
    number of rounds done, as the plots' x axis), None for a curve with no figure."""
    scored = [(v, r) for r, v in enumerate(curve, start=1) if v is not None and not math.isnan(v)]
    if not scored:
        return float("nan"), None
    best = max(v for v, _ in scored)
    return best, next(r for v, r in scored if v == best)  # the first round to reach it


def run_summary(result: RunResult) -> dict[str, Any]:
    final = final_accuracy(result)
    per_domain: dict[str, list[float]] = {}
    for c in result.clients:
        per_domain.setdefault(c.domain, []).append(final[c.name])
    answered = [
        (u, d) for c in result.clients for u, d in zip(c.bytes_up, c.bytes_down, strict=True) if u
    ]
    by_round = [_mean([c.accuracy[r] for c in result.clients]) for r in range(result.spec.rounds)]
    best, best_round = best_of(by_round)
    return {
        "accuracy": {c.name: list(c.accuracy) for c in result.clients},
        "final": final,
        "final_mean": _mean(list(final.values())),
        # The round whose mean over clients is highest: read as the papers' best-round
        # figures are, and optimistic as they are (the round is chosen on the test splits).
        "best_mean": best,
        "best_round": best_round,
        "final_mean_prototype": _mean(list(final_accuracy(result, "accuracy_prototype").values())),
        "final_mean_classifier": _mean(
            list(final_accuracy(result, "accuracy_classifier").values())
        ),
        "mean_by_round": by_round,
        "per_domain": {d: _mean(v) for d, v in per_domain.items()},
        "bytes_up": {c.name: list(c.bytes_up) for c in result.clients},
        "bytes_down": {c.name: list(c.bytes_down) for c in result.clients},
        "bytes_up_per_client_round": _mean([u for u, _ in answered]),
        "bytes_down_per_client_round": _mean([d for _, d in answered]),
        "round_seconds": list(result.round_seconds),
        "wall_seconds": result.wall_seconds,
        "peak_mb": result.peak_mb,
        "run_dir": str(result.spec.out),
    }


def build_report(
    results: dict[str, dict[int, RunResult]], *, config: dict[str, Any], partition: str
) -> dict[str, Any]:
    """``results[method][seed]`` -> the report.json document. A ``central`` entry is the
    comparison's ceiling (fleet.report.central)."""
    methods: dict[str, Any] = {}
    for method, by_seed in results.items():
        runs = {str(seed): run_summary(r) for seed, r in sorted(by_seed.items())}
        finals = [runs[s]["final_mean"] for s in runs]
        bests = [runs[s]["best_mean"] for s in runs]
        domains = sorted({d for r in runs.values() for d in r["per_domain"]})
        spec = next(iter(by_seed.values())).spec
        methods[method] = {
            "runs": runs,
            "final_mean": _mean(finals),
            "final_std": _std(finals),
            "best_mean": _mean(bests),
            "best_std": _std(bests),
            "best_round": {s: runs[s]["best_round"] for s in runs},  # per seed
            "final_mean_prototype": _mean([runs[s]["final_mean_prototype"] for s in runs]),
            "final_mean_classifier": _mean([runs[s]["final_mean_classifier"] for s in runs]),
            "per_domain": {
                d: _mean([r["per_domain"].get(d) for r in runs.values()]) for d in domains
            },
            "per_domain_std": {
                d: _std([r["per_domain"].get(d) for r in runs.values()]) for d in domains
            },
            "mean_by_round": [
                _mean([r["mean_by_round"][i] for r in runs.values()])
                for i in range(len(next(iter(runs.values()))["mean_by_round"]))
            ],
            "bytes_up_per_client_round": _mean(
                [r["bytes_up_per_client_round"] for r in runs.values()]
            ),
            "bytes_down_per_client_round": _mean(
                [r["bytes_down_per_client_round"] for r in runs.values()]
            ),
            "peak_mb": max(r["peak_mb"] for r in runs.values()),
            # The [train] settings the method ran with beyond the agents' defaults: what
            # the protocol, --train-param and the sweep's own settings made of them.
            "train": dict(spec.extra_train),
            # Everything that shaped the arm, in full.
            "settings": arm_settings(spec, protocol=config.get("protocol")),
        }
    return {"config": config, "partition": partition, "methods": methods}


def arm_settings(spec: RunSpec, *, protocol: str | None) -> dict[str, Any]:
    """One arm's full settings: protocol, every [train] key (defaults included), how it
    predicts, rounds, transport and privacy."""
    from edge_agent.train_config import TrainConfig
    from fleet.report.central import CENTRAL
    from fleet.transports.spec import train_table
    from runtime.settings import build

    if spec.method == CENTRAL:
        inference = "classifier (one head on every client's training data pooled)"
    else:
        from edge_agent.inference import rule_of  # numpy only

        inference = rule_of(spec.method).rule
    return {
        "protocol": protocol,
        "train": asdict(build(TrainConfig, train_table(spec), prefix="train.")),
        "inference": inference,
        "rounds": spec.rounds,
        "transport": spec.transport,
        "downlink_budget": spec.downlink_budget,
        "stats_dim": spec.stats_dim,
        "privacy": dict(spec.privacy) or {"mechanism": "none"},
    }


def _cell(mean: float, std: float, *, with_std: bool = True) -> str:
    if math.isnan(mean):
        return "-"
    return f"{100 * mean:.1f} ({100 * std:.1f})" if with_std else f"{100 * mean:.1f}"


def _seeds(methods: dict[str, Any]) -> list[str]:
    return sorted({s for m in methods.values() for s in m["runs"]})


def settings(config: dict[str, Any], train: dict[str, dict[str, Any]] | None = None) -> str:
    """What shaped the figures besides the data, so that two reports can be told apart
    without their JSON: '30 rounds, 1 local epoch per round, ...', or ''. ``train`` as
    for :func:`train_note`."""
    parts = []
    if "rounds" in config:
        parts.append(f"{config['rounds']} rounds")
    if "epochs" in config:
        parts.append(
            f"{config['epochs']} local epoch{'' if config['epochs'] == 1 else 's'} per round"
        )
    if "out_dim" in config:
        parts.append(f"head output {config['out_dim']}")
    if "transport" in config:
        parts.append(f"{config['transport']} transport")
    budget = config.get("downlink_budget", DEFAULT_BUDGET)
    if budget != DEFAULT_BUDGET:  # named when not the deployed default
        parts.append("every local set announced" if budget == 0 else f"downlink {budget:,} bytes")
    if note := train_note(config, train):
        parts.append(note)
    return ", ".join(parts)


def method_train(report: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """Each method's [train] settings in a fleet report, or None in a report that does not
    record them per method."""
    methods = report.get("methods") or {}
    if not methods or not all("train" in m for m in methods.values()):
        return None
    return {name: m["train"] for name, m in methods.items()}


def train_note(config: dict[str, Any], train: dict[str, dict[str, Any]] | None = None) -> str:
    """The [train] settings beyond the agents' defaults, or '': 'train: tau=0.2' for
    those every method had, 'classifier=bounded for solo and fedavg' for those of some
    methods only. ``train`` maps each method to its settings; without it, the
    ``--train-param`` of ``config`` are every method's."""
    if not train:
        train = {"": config.get("train_param") or {}}
    tables = list(train.values())
    common = {k: v for k, v in tables[0].items() if all(k in t and t[k] == v for t in tables)}
    parts = [f"{k}={v}" for k, v in sorted(common.items())]
    some: dict[str, list[str]] = {}
    for name, table in train.items():
        for k, v in sorted(table.items()):
            if k not in common:
                some.setdefault(f"{k}={v}", []).append(name)
    for setting, names in sorted(some.items()):
        listed = ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]
        parts.append(f"{setting} for {listed}")
    return "train: " + ", ".join(parts) if parts else ""


def _best_cell(m: dict[str, Any], *, with_std: bool) -> str:
    """'74.1 (0.6) @ 14-20': best-round mean (std) over seeds and the rounds they peaked."""
    rounds = sorted(r for r in (m.get("best_round") or {}).values() if r is not None)
    if not rounds:
        return _cell(m.get("best_mean", math.nan), 0.0, with_std=False)
    at = str(rounds[0]) if rounds[0] == rounds[-1] else f"{rounds[0]}-{rounds[-1]}"
    return f"{_cell(m['best_mean'], m['best_std'], with_std=with_std)} @ {at}"


def protocol_line(config: dict[str, Any]) -> str:
    """'Fair protocol: every method ...' for a report made under a --protocol, or ''."""
    from fleet.transports.protocols import PROTOCOLS

    chosen = PROTOCOLS.get(config.get("protocol") or "")
    return chosen.summary[0].upper() + chosen.summary[1:] + "." if chosen else ""


def markdown(report: dict[str, Any]) -> str:
    """Methods as rows, domains as columns, final accuracy in % as mean (std) over seeds,
    then the final and best-round means; the ceiling (central) last."""
    from fleet.report.central import CENTRAL

    everything = report["methods"]
    methods = {k: v for k, v in everything.items() if k != CENTRAL}
    domains = sorted({d for m in everything.values() for d in m["per_domain"]})
    seeds = _seeds(everything)
    config = report.get("config", {})
    train = method_train({"methods": methods})
    head = ["method", *domains, "final", "best (round)"]
    several = len(seeds) > 1
    over = f"mean (std) over seeds {', '.join(seeds)}" if several else f"seed {seeds[0]}"
    protocol = config.get("protocol")
    lines = [
        f"# Fleet report, {protocol} protocol: {report['partition']}"
        if protocol
        else f"# Fleet report: {report['partition']}",
        "",
        *([line, ""] if (line := protocol_line(config)) else []),
        f"Test accuracy (%) of each client on its own test split, {over}: by domain and "
        "overall after the last round (final), and the best round's overall mean with the "
        "round(s) it came in (best; chosen on the test splits, so optimistic, as papers' "
        "best-round figures are).",
        *([f"Settings: {line}."] if (line := settings(config, train)) else []),
        *(
            [
                f"{CENTRAL} is the ceiling: one linear head trained on every client's "
                "training data pooled, same head, optimiser and epochs; solo is the floor."
            ]
            if CENTRAL in everything
            else []
        ),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    for name, m in everything.items():
        cells = [
            _cell(
                m["per_domain"].get(d, math.nan), m["per_domain_std"].get(d, 0.0), with_std=several
            )
            for d in domains
        ]
        cells.append(_cell(m["final_mean"], m["final_std"], with_std=several))
        cells.append(_best_cell(m, with_std=several))
        label = f"{name} (ceiling)" if name == CENTRAL else name
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Every method by both device-side rules on each device's own trained head "
        f"({'mean over seeds' if several else f'seed {seeds[0]}'}, final round, %).",
        f"The table above uses each method's own rule: {_rules(list(methods))}.",
        *_no_classifier(list(methods)),
        "",
        "| method | cosine to local prototypes | classifier |",
        "|---|---:|---:|",
    ]
    for name, m in methods.items():
        lines.append(
            f"| {name} | {_cell(m['final_mean_prototype'], 0.0, with_std=False)} | "
            f"{_cell(m['final_mean_classifier'], 0.0, with_std=False)} |"
        )
    lines += [
        "",
        "| method | bytes up / client / round | bytes down / client / round | peak MB |",
        "|---|---:|---:|---:|",
    ]
    for name, m in methods.items():
        lines.append(
            f"| {name} | {m['bytes_up_per_client_round']:,.0f} | "
            f"{m['bytes_down_per_client_round']:,.0f} | {m['peak_mb']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def write(
    report: dict[str, Any], out: Path, *, extra_plots: dict[str, Path] | None = None
) -> dict[str, Path]:
    from fleet.report.plots import plot_accuracy, plot_domains  # matplotlib: only when writing

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(to_json(report))
    (out / "report.md").write_text(markdown(report))
    plots = {"accuracy": plot_accuracy(report, out / "accuracy_vs_round.png"),
             "domains": plot_domains(report, out / "accuracy_per_domain.png")}  # fmt: skip
    return {
        "report.json": out / "report.json",
        "report.md": out / "report.md",
        **plots,
        **(extra_plots or {}),
    }


def _rules(methods: Sequence[str]) -> str:
    """'fedpcl by cosine similarity to its local prototypes; ...' for the methods shown,
    those that share a rule named together."""
    from edge_agent.methods import DEVICE_METHODS

    by_text: dict[str, list[str]] = {}
    for m in methods:
        rule = DEVICE_METHODS[m].rule if m in DEVICE_METHODS else None
        by_text.setdefault(rule.summary if rule else "its classifier", []).append(m)
    parts = []
    for text, users in by_text.items():
        who = " and ".join([", ".join(users[:-1]), users[-1]] if len(users) > 1 else users)
        parts.append(f"{who} by {text}")
    return "; ".join(parts)


def _no_classifier(methods: Sequence[str]) -> list[str]:
    """The note for the methods that train no classifier, if any is shown."""
    from edge_agent.methods import DEVICE_METHODS

    free = [m for m in methods if m in DEVICE_METHODS and DEVICE_METHODS[m].classifier_free]
    return (
        [f'{" and ".join(free)}: no classifier is trained (the head alone): "-".'] if free else []
    )


def to_json(document: Any) -> str:
    """Strict JSON: a figure that does not exist (NaN: a method with no classifier, a
    domain with no client) is null, which every JSON reader accepts; NaN is not JSON."""
    return json.dumps(_plain(document), indent=1, allow_nan=False)


def _plain(value: Any) -> Any:
    """JSON's own types: dataclasses as objects, paths as strings, numpy scalars as
    numbers, and NaN or infinity as null."""
    if hasattr(value, "__dataclass_fields__"):
        value = asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value
