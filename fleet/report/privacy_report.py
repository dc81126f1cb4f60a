"""The report of ``edge-fleet privacy``: accuracy against epsilon per digits-5 setting (or
--data file), each formal arm's guarantee, the label-inference attack, as Markdown and a
plot; with ``--closed-form``, the closed-form method's local against distributed noise."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Curve:
    """One arm of the plot: its rows in a split's results (``{e}`` stands for each epsilon;
    none for an arm without privacy, drawn as a level line), its label, and a colour and
    line style no other arm has, so every arm reads apart whatever the legend's order."""

    row: str
    label: str
    colour: str
    style: str | tuple[int, tuple[int, ...]]
    marker: str | None = None


def curves(document: dict[str, Any]) -> list[Curve]:
    """The arms of ``edge-fleet privacy``'s plot, in the legend's order."""
    out = [
        Curve("fedpcl dp eps={e}", "DP FedPCL (DP-SGD)", "C0", "-", "o"),
        Curve("fedpcl dp-features eps={e}", "FedPCL, dp-features release", "C1", "-.", "s"),
    ]
    mechanisms = document.get("mechanisms", ["dp"])
    out = [c for c in out if c.row.split()[1] in mechanisms]
    out.append(Curve("fedpcl (no privacy)", "FedPCL without privacy", "C2", ":"))
    if method := document.get("closed_form"):
        out += [
            Curve(f"{method} dp-features eps={{e}}", f"{method}, each device's noise", "C3",
                  "--", "^"),
            Curve(f"{method} secure eps={{e}}", f"{method}, secure sum's noise", "C4",
                  (0, (5, 1)), "D"),
            Curve(f"{method} exact sum (no privacy)", f"{method}, exact sum", "C5", (0, (1, 3))),
        ]  # fmt: skip
    out.append(Curve("solo (no privacy)", "Solo (shares nothing)", "C7", (0, (3, 1, 1, 1, 1, 1))))
    return out


def plot_accuracy_vs_epsilon(document: dict[str, Any], path: Path) -> Path:
    """One panel per split, each arm in its own colour and style."""
    plt = pyplot()
    splits = list(document["results"].items())
    fig, axes = plt.subplots(1, len(splits), figsize=(3.6 * len(splits) + 3.2, 4.2), dpi=120,
                             sharey=True, squeeze=False)  # fmt: skip
    epsilons = document["epsilons"]
    arms = curves(document)
    for i, (ax, (split, rows)) in enumerate(zip(axes[0], splits, strict=True)):
        last = i == len(splits) - 1  # the legend is drawn once, beside the last panel
        for arm in arms:
            label = arm.label if last else None
            if arm.marker is None:
                ax.axhline(100 * rows[arm.row], color=arm.colour, linestyle=arm.style,
                           label=label)  # fmt: skip
                continue
            ys = [100 * rows[arm.row.format(e=f"{e:g}")] for e in epsilons]
            ax.plot(epsilons, ys, marker=arm.marker, linestyle=arm.style, color=arm.colour,
                    label=label)  # fmt: skip
        ax.set_title(_label(split, document), fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
        ax.set_xlabel(f"epsilon (delta {document['delta']:g}, whole run)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final mean test accuracy (%)")
    return finish(plt, fig, axes[0][-1], path, legend_size=7)
