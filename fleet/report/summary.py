"""Reports of simulated fleets: the figures of each run and of each method over seeds
(report.json), written with their Markdown table (report.md) and PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.inference import rule_of
from edge_agent.train_config import TrainConfig
from fleet.report.central import CENTRAL
from fleet.report.markdown import markdown
from fleet.report.plots import plot_accuracy, plot_domains
from fleet.transports.secure import agent_tables
from fleet.transports.spec import RunResult, RunSpec, train_table
from runtime.settings import build
from secagg.fleet import SecureAggregation


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
        first = next(iter(by_seed.values()))
        spec = first.spec
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
            "settings": arm_settings(spec, protocol=config.get("protocol"), secure=first.secure),
        }
    return {"config": config, "partition": partition, "methods": methods}


def arm_settings(
    spec: RunSpec, *, protocol: str | None, secure: SecureAggregation | None = None
) -> dict[str, Any]:
    """One arm's full settings: protocol, every [train] key (defaults included), how it
    predicts, rounds, transport (and coordinator workers) and privacy: the agents' own
    [privacy] table and, under --secure-aggregation, the fleet's public
    [secure_aggregation] table ``secure`` (its noise in place of the agents')."""
    if spec.method == CENTRAL:
        inference = "classifier (one head on every client's training data pooled)"
    else:
        inference = rule_of(spec.method).rule
    return {
        "protocol": protocol,
        "train": asdict(build(TrainConfig, train_table(spec), prefix="train.")),
        "inference": inference,
        "rounds": spec.rounds,
        "transport": spec.transport,
        # How many workers the coordinator took the updates in over; None: one process.
        "coordinator_workers": spec.coordinator_workers,
        "downlink_budget": spec.downlink_budget,
        "stats_dim": spec.stats_dim,
        "stats_basis": bool(spec.stats_basis),
        "privacy": agent_privacy(spec, secure),
        "secure_aggregation": None if secure is None else asdict(secure),
    }


def agent_privacy(spec: RunSpec, secure: SecureAggregation | None) -> dict[str, Any]:
    """The [privacy] table the agents ran with (fleet/transports/configs.py)."""
    if secure is not None:
        return agent_tables(secure)["privacy"]
    return dict(spec.privacy) or {"mechanism": "none"}


def write(
    report: dict[str, Any], out: Path, *, extra_plots: dict[str, Path] | None = None
) -> dict[str, Path]:
    """report.json, report.md and the plots into ``out``; each file's path by its name."""
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
