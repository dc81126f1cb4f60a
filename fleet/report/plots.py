"""The PNG plots of a fleet report: accuracy by round, final accuracy per domain, and the
backbone-contribution heat map."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.methods import FLOOR
from fleet.report.central import CENTRAL
from fleet.report.notes import method_train, seeds_of, train_note


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend."""
    # matplotlib: only a command that draws pays for it, not edge-fleet --help.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(report: dict[str, Any], text: str) -> str:
    config = report.get("config", {})
    note = train_note(
        config, method_train({"methods": {k: v for k, v in report["methods"].items()
                                          if k != CENTRAL}})
    )  # fmt: skip
    protocol = f"{config['protocol']} protocol; " if config.get("protocol") else ""
    return protocol + text + (f"; {note}" if note else "")


def plot_accuracy(report: dict[str, Any], path: Path) -> Path:
    """Each method's mean accuracy by round (band: std over seeds); the ceiling (central)
    and the floor (solo's final) as horizontal lines."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, m in report["methods"].items():
        if name == CENTRAL:
            ax.axhline(100 * m["final_mean"], color="black", linestyle="--", linewidth=1.2,
                       label=f"{CENTRAL}: pooled data (ceiling)")  # fmt: skip
            continue
        runs = list(m["runs"].values())
        curves = np.array([r["mean_by_round"] for r in runs], dtype=float) * 100
        mean = np.nanmean(curves, axis=0)
        rounds = np.arange(1, len(mean) + 1)
        (line,) = ax.plot(rounds, mean, marker="o", markersize=3, label=name)
        if len(runs) > 1:
            std = np.nanstd(curves, axis=0)
            ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.15)
        if name == FLOOR:
            ax.axhline(100 * m["final_mean"], color=line.get_color(), linestyle=":",
                       linewidth=1.2, label="solo final (floor)")  # fmt: skip
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy (%)")
    ax.set_title(_title(report, report["partition"]), fontsize=9)
    return finish(plt, fig, ax, path)


def finish(plt: Any, fig: Any, ax: Any, path: Path, *, legend_size: int = 8) -> Path:
    """Grid, legend outside the axes (never over the data), save, close."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_domains(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    methods = report["methods"]
    domains = sorted({d for m in methods.values() for d in m["per_domain"]})
    if len(domains) > 12:  # one bar group per client would be unreadable: show the mean
        domains = []
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * (len(domains) + 1) + 2), 4.2), dpi=120)
    groups = [*domains, "mean"]
    bars = {k: v for k, v in methods.items() if k != CENTRAL}
    width = 0.8 / max(1, len(bars))
    x = np.arange(len(groups))
    seeds = seeds_of(methods)
    several = len(seeds) > 1  # one seed has no spread: no error bars that are always 0
    for i, (name, m) in enumerate(bars.items()):
        values = [m["per_domain"].get(d, math.nan) for d in domains] + [m["final_mean"]]
        errors = [m["per_domain_std"].get(d, 0.0) for d in domains] + [m["final_std"]]
        ax.bar(x + i * width - 0.4 + width / 2, np.array(values) * 100, width,
               yerr=np.array(errors) * 100 if several else None, capsize=2, label=name)  # fmt: skip
    if CENTRAL in methods:  # the ceiling of each group as a line across its bars
        m = methods[CENTRAL]
        values = [m["per_domain"].get(d, math.nan) for d in domains] + [m["final_mean"]]
        ax.hlines(np.array(values) * 100, x - 0.42, x + 0.42, colors="black",
                  linestyles="--", linewidth=1.2, label=f"{CENTRAL} (ceiling)")  # fmt: skip
    ax.set_xticks(x, groups)
    ax.set_ylabel("final test accuracy (%)")
    ax.set_ylim(0, 100)
    over = "mean over seeds, bars: std" if several else f"seed {seeds[0]}"
    ax.set_title(_title(report, f"final accuracy per domain ({over})"), fontsize=9)
    return finish(plt, fig, ax, path)


def plot_contribution(
    domains: list[str], backbones: list[str], matrix: np.ndarray, path: Path, *, method: str
) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.6 * len(backbones) + 2.5, 0.55 * len(domains) + 1.8), dpi=120)
    # The scale starts just below the smallest value so differences between backbones show.
    low = max(-1.0, math.floor((float(matrix.min()) - 0.05) * 10) / 10)
    image = ax.imshow(matrix, cmap="viridis", vmin=low, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(backbones)), backbones)
    ax.set_yticks(range(len(domains)), domains)
    for i in range(len(domains)):
        for j in range(len(backbones)):
            value = matrix[i, j]
            ax.text(j, i, f"{value:.2f}", ha="center", va="center",
                    color="black" if value > (low + 1) / 2 else "white", fontsize=9)  # fmt: skip
    ax.set_xlabel("single backbone")
    ax.set_title(f"{method}: similarity of single- to multi-backbone prototypes", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="cosine similarity")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
