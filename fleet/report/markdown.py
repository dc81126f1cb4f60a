"""A fleet report as Markdown: the Table-2-shaped table of methods by domain, each
method by both device-side rules, and the traffic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from edge_agent.methods import DEVICE_METHODS
from fleet.report.central import CENTRAL
from fleet.report.notes import method_train, protocol_line, secure_lines, seeds_of, settings


def _cell(mean: float, std: float, *, with_std: bool = True) -> str:
    if math.isnan(mean):
        return "-"
    return f"{100 * mean:.1f} ({100 * std:.1f})" if with_std else f"{100 * mean:.1f}"


def _best_cell(m: dict[str, Any], *, with_std: bool) -> str:
    """'74.1 (0.6) @ 14-20': best-round mean (std) over seeds and the rounds they peaked."""
    rounds = sorted(r for r in (m.get("best_round") or {}).values() if r is not None)
    if not rounds:
        return _cell(m.get("best_mean", math.nan), 0.0, with_std=False)
    at = str(rounds[0]) if rounds[0] == rounds[-1] else f"{rounds[0]}-{rounds[-1]}"
    return f"{_cell(m['best_mean'], m['best_std'], with_std=with_std)} @ {at}"


def markdown(report: dict[str, Any]) -> str:
    """Methods as rows, domains as columns, final accuracy in % as mean (std) over seeds,
    then the final and best-round means; the ceiling (central) last."""
    everything = report["methods"]
    methods = {k: v for k, v in everything.items() if k != CENTRAL}
    domains = sorted({d for m in everything.values() for d in m["per_domain"]})
    seeds = seeds_of(everything)
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
        *secure_lines(methods),
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


def _rules(methods: Sequence[str]) -> str:
    """'fedpcl by cosine similarity to its local prototypes; ...' for the methods shown,
    those that share a rule named together."""
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
    free = [m for m in methods if m in DEVICE_METHODS and DEVICE_METHODS[m].classifier_free]
    return (
        [f'{" and ".join(free)}: no classifier is trained (the head alone): "-".'] if free else []
    )
