"""The report of ``edge-fleet privacy``: accuracy against epsilon per digits-5 setting (or
--data file), each formal arm's guarantee, the label-inference attack, as Markdown and a
plot; with ``--closed-form``, the closed-form method's local against distributed noise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleet.report.notes import protocol_line, settings
from fleet.report.plots import finish, pyplot

#: The formal mechanisms a privacy sweep runs: their arms claim a guarantee.
FORMAL = ("dp", "dp-features")


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
        *_closed_form_lines(document),
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
    """What each formal arm's epsilon is worth, said once for the table: a device's own
    release's, or a secure sum's (noised: epsilon above 0)."""
    claims = {v.get("guarantee") for v in document.get("privacy", {}).values()
              if v.get("mechanism") in FORMAL
              or (v.get("aggregation") == "secure" and v.get("epsilon", 0) > 0)}  # fmt: skip
    return [f"Formal arms' guarantee: {c}." for c in sorted(c for c in claims if c)]


def _closed_form_lines(document: dict[str, Any]) -> list[str]:
    """What the --closed-form arms compare, with the secure sum's public settings."""
    method = document.get("closed_form")
    if not method:
        return []
    tables = [v["secure_aggregation"] for v in document.get("settings", {}).values()
              if v.get("secure_aggregation")]  # fmt: skip
    exact = document.get("settings", {}).get(f"{method} exact sum (no privacy)", {})
    k = exact.get("stats_dim")
    public = ""
    if tables:
        t = tables[0]
        public = (
            f" (threshold {t['threshold']}, {t['colluding']} colluding, {t['dataset_size']} "
            f"samples a device at most, a {t['bits']}-bit ring)"
        )
    return [
        f"{method} (vector transport{f', statistics in k = {k}' if k else ''}), the same "
        f"budget per arm: `dp-features`, each device noises its own statistics; `secure`, "
        f"only the fleet's secure sum reaches the coordinator and its distributed noise "
        f"spends the epsilon once{public}; `exact sum`, no noise."
    ]


LINE_STYLES = {"dp": ("o", "-"), "dp-features": ("s", "-.")}
LABELS = {"dp": "DP FedPCL (DP-SGD)", "dp-features": "FedPCL, dp-features release"}
CLOSED_FORM_STYLES = {"dp-features": ("^", "--"), "secure": ("D", "-")}
CLOSED_FORM_LABELS = {"dp-features": "each device's noise", "secure": "secure sum's noise"}


def plot_accuracy_vs_epsilon(document: dict[str, Any], path: Path) -> Path:
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
        if method := document.get("closed_form"):
            for kind, (marker, style) in CLOSED_FORM_STYLES.items():
                ys = [100 * rows[f"{method} {kind} eps={e:g}"] for e in epsilons]
                ax.plot(epsilons, ys, marker=marker, linestyle=style, color=colour,
                        label=f"{method}, {CLOSED_FORM_LABELS[kind]}, {split}")  # fmt: skip
            ax.axhline(100 * rows[f"{method} exact sum (no privacy)"], color=colour,
                       linestyle=(0, (1, 3)), label=f"{method}, exact sum, {split}")  # fmt: skip
        ax.axhline(100 * rows["solo (no privacy)"], color=colour, linestyle="--",
                   label=f"Solo (shares nothing), {split}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    ax.set_xlabel(f"epsilon (delta {document['delta']:g}, whole run)")
    ax.set_ylabel("final mean test accuracy (%)")
    ax.set_ylim(0, 100)
    return finish(plt, fig, ax, path, legend_size=7)
