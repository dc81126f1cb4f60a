"""The accuracy figures: the comparison tables, FedPCL's targets, the demo and README's
summary, each from bench/accuracy.json (``make bench-accuracy``)."""

from __future__ import annotations

from collections.abc import Callable

from bench.closed_form_bench import DP_KS, EPSILONS, FLEETS, KS
from bench.figure_results import ACCURACY, CLOSED_FORM, Results, num, pct
from protocol.methods import WIRE_METHODS

#: Every recorded method, in the records' order, and the pooled-data head (the ceiling).
METHODS = (*WIRE_METHODS, "central")
SETTING_NAMES = {"feature": "feature shift", "label": "label shift (alpha 0.5)",
                 "feature-label": "feature & label shift", "glyphs": "glyphs-5"}  # fmt: skip


def _final(r: Results, prefix: str) -> str:
    mean, std = r.get(f"{prefix}.final_mean"), r.get(f"{prefix}.final_std")
    return "-" if mean is None else f"{pct(mean)} ({pct(std)})"


def _best(r: Results, prefix: str) -> str:
    mean, std = r.get(f"{prefix}.best_mean"), r.get(f"{prefix}.best_std")
    low, high = r.get(f"{prefix}.best_round_min"), r.get(f"{prefix}.best_round_max")
    if mean is None:
        return "-"
    at = (
        ""
        if low is None or high is None
        else (f" @ {low:.0f}" if low == high else f" @ {low:.0f}-{high:.0f}")
    )
    return f"{pct(mean)} ({pct(std)}){at}"


def _accuracy_caption(r: Results) -> str:
    rounds, clients, seeds = (r.get(f"accuracy.{k}") for k in ("rounds", "clients", "seeds"))
    if rounds is None or clients is None or seeds is None:
        return "Not measured: run `make bench-accuracy`."
    return (
        f"{clients:.0f} clients, the full zoo, {rounds:.0f} rounds, {seeds:.0f} seeds (0-"
        f"{seeds - 1:.0f}); test accuracy in %, mean (std) over seeds: final round, and best "
        "round with the round(s) it came in (chosen on the test splits: optimistic). "
        f"Measured by `make bench-accuracy`: {r.provenance(ACCURACY)}."
    )


def protocol_table(protocol: str) -> Callable[[Results], str]:
    def block(r: Results) -> str:
        settings = ("feature", "label", "feature-label")
        head = ["method"] + [
            f"{SETTING_NAMES[s]}: {w}" for s in settings for w in ("final", "best")
        ]
        lines = [_accuracy_caption(r), "", "| " + " | ".join(head) + " |",
                 "|---" + "|---:" * (len(head) - 1) + "|"]  # fmt: skip
        for method in METHODS:
            cells = []
            for s in settings:
                prefix = f"accuracy.{protocol}.{s}.{method}"
                cells += [_final(r, prefix), _best(r, prefix)]
            label = f"{method} (ceiling)" if method == "central" else method
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    return block


def glyphs_table(r: Results) -> str:
    head = ["method"] + [f"{p}: {w}" for p in ("fair", "paper") for w in ("final", "best")]
    lines = [_accuracy_caption(r), "", "| " + " | ".join(head) + " |",
             "|---" + "|---:" * (len(head) - 1) + "|"]  # fmt: skip
    for method in METHODS:
        cells = []
        for p in ("fair", "paper"):
            prefix = f"accuracy.{p}.glyphs.{method}"
            cells += [_final(r, prefix), _best(r, prefix)]
        label = f"{method} (ceiling)" if method == "central" else method
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: FedPCL's margins the comparison is held to (final means over seeds, points).
TARGETS = {"solo": 1.0, "fedavg": -3.0, "fedproto": -2.0}


def targets(r: Results) -> str:
    """FedPCL's margin over each baseline in the fair protocol, against its target."""
    lines = [
        "| setting (fair protocol) | "
        + " | ".join(f"fedpcl - {b} (target {t:+.0f})" for b, t in TARGETS.items())
        + " |",
        "|---" + "|---:" * len(TARGETS) + "|",
    ]
    for setting in ("feature", "label", "feature-label", "glyphs"):
        mine = r.get(f"accuracy.fair.{setting}.fedpcl.final_mean")
        cells = []
        for baseline, target in TARGETS.items():
            theirs = r.get(f"accuracy.fair.{setting}.{baseline}.final_mean")
            if mine is None or theirs is None:
                cells.append("not measured")
                continue
            gap = 100 * (mine - theirs)
            cells.append(f"{gap:+.1f} ({'met' if gap >= target - 1e-9 else 'missed'})")
        lines.append(f"| {SETTING_NAMES[setting]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The closed-form targets (issue 39): LDA's final mean against the ceiling or Solo, points.
CLOSED_FORM_TARGETS = {
    "feature": ("central", 1.0),
    "label": ("central", 0.0),
    "feature-label": ("central", 0.0),
    "glyphs": ("solo", 3.0),
}


def closed_form_targets(r: Results) -> str:
    """LDA's margin in each setting against the row it is held to (fair protocol), and
    the round it reached its final accuracy in."""
    lines = ["| setting (fair protocol) | lda | held to | margin (target) | final reached in round |",
             "|---|---:|---|---:|---:|"]  # fmt: skip
    for setting, (row, target) in CLOSED_FORM_TARGETS.items():
        mine = r.get(f"accuracy.fair.{setting}.lda.final_mean")
        theirs = r.get(f"accuracy.fair.{setting}.{row}.final_mean")
        first = r.get(f"accuracy.fair.{setting}.lda.first_final_round")
        if mine is None or theirs is None:
            lines.append(f"| {SETTING_NAMES[setting]} | not measured | {row} | - | - |")
            continue
        gap = 100 * (mine - theirs)
        verdict = "met" if gap >= target - 1e-9 else "missed"
        lines.append(
            f"| {SETTING_NAMES[setting]} | {pct(mine)} | {row} {pct(theirs)} | "
            f"{gap:+.1f} ({target:+.0f}: {verdict}) | {num(first)} |"
        )
    return "\n".join(lines)


def demo(r: Results) -> str:
    """The table `make demo` prints (seed 0, feature shift, over MQTT)."""
    domains = sorted(
        {k.split(".")[3] for k in r.values if k.startswith("accuracy.demo.solo.")} - {"mean"}
    )
    if not domains:
        return "Not measured: run `make bench-accuracy`."
    lines = ["| method | " + " | ".join(domains) + " | final | best (round) |",
             "|---" + "|---:" * (len(domains) + 2) + "|"]  # fmt: skip
    for method in ("solo", "fedavg", "fedproto", "fedpcl", "lda", "central"):
        cells = [pct(r.get(f"accuracy.demo.{method}.{d}")) for d in [*domains, "mean"]]
        best, at = (
            r.get(f"accuracy.demo_best.{method}.mean"),
            r.get(f"accuracy.demo_best.{method}.round"),
        )
        cells.append("-" if best is None or at is None else f"{pct(best)} @ {at:.0f}")
        label = f"{method} (ceiling)" if method == "central" else method
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    seconds = r.get("accuracy.demo.wall_seconds")
    return (
        "```\n"
        + "\n".join(lines)
        + "\n```\n\n"
        + f"(the rows of its table, seed 0; from `make bench-accuracy`: "
        f"{r.provenance(ACCURACY)}; the fleet runs took {num(seconds)} s in all)"
    )


def comparison(r: Results) -> str:
    """README's summary of the fair comparison under feature shift."""
    get = {m: r.get(f"accuracy.fair.feature.{m}.final_mean") for m in METHODS}
    paper = {m: r.get(f"accuracy.paper.feature.{m}.final_mean") for m in METHODS}
    if any(v is None for v in get.values()):
        return "Not measured: run `make bench-accuracy`."
    return (
        f"Under feature shift, over seeds 0-2, final round (fair protocol): Solo "
        f"{pct(get['solo'])}, FedAvg {pct(get['fedavg'])}, FedProto {pct(get['fedproto'])}, "
        f"FedPCL {pct(get['fedpcl'])}, FPL {pct(get['fpl'])}, FedDBP {pct(get['feddbp'])}; "
        f"one head on the pooled data (the ceiling) {pct(get['central'])}. From the class "
        f"statistics, in one round: LDA {pct(get['lda'])}, ridge {pct(get['ridge'])}, "
        f"FedCOF {pct(get['fedcof'])}. Under the paper's "
        f"protocol Solo gives {pct(paper['solo'])} and FedAvg {pct(paper['fedavg'])}. "
        f"Measured by `make bench-accuracy`: {r.provenance(ACCURACY)}."
    )


def closed_form_privacy(r: Results) -> str:
    """LDA under dp-features against epsilon and fleet size, beside Solo (bench/closed_form.json)."""
    if r.get(f"closed_form.dp{FLEETS[0][0]}.solo_acc") is None:
        return "Not measured: run `make bench-closed-form`."
    head = [f"k {k}, eps {'none' if e == float('inf') else f'{e:g}'}" for k in DP_KS
            for e in EPSILONS]  # fmt: skip
    lines = [
        "Test accuracy (%), digits-5 feature shift, mean over seeds 0-2, delta 1e-5; each "
        "device noises its own statistics once; Solo on the same clients (its own head and "
        "classifier, 20 rounds). Measured by `make bench-closed-form`: "
        f"{r.provenance(CLOSED_FORM)}.",
        "",
        "| devices x samples | solo | " + " | ".join(head) + " |",
        "|---" + "|---:" * (len(head) + 1) + "|",
    ]
    for devices, train, _ in FLEETS:
        cells = [pct(r.get(f"closed_form.dp{devices}.solo_acc"))]
        cells += [pct(r.get(f"closed_form.dp{devices}.k{k}.eps{e:g}.lda_acc"))
                  for k in DP_KS for e in EPSILONS]  # fmt: skip
        lines.append(f"| {devices:,} x {train} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def closed_form(r: Results) -> str:
    """docs/fleet.md's closed-form block: LDA against k, against epsilon and fleet size,
    and at 1,000 and 10,000 clients (bench/closed_form.json)."""
    if r.get(f"closed_form.k{KS[0]}.lda_acc") is None:
        return "Not measured: run `make bench-closed-form`."
    lines = [
        "LDA on digits-5 feature shift, 5 devices of 100 samples, seeds 0-2, against the "
        "projection size k (none: the zoo's 896 features), and the bytes of its one "
        "statistics update. Measured by `make bench-closed-form`: "
        f"{r.provenance(CLOSED_FORM)}.",
        "",
        "| k | lda final (%) | statistics update (bytes) |",
        "|---:|---:|---:|",
    ]
    for k in KS:
        lines.append(f"| {k or 'none (896)'} | {pct(r.get(f'closed_form.k{k}.lda_acc'))} | "
                     f"{num(r.get(f'closed_form.k{k}.bytes_up'))} |")  # fmt: skip
    scale = []
    for clients in (1000, 10_000):
        s, peak = (
            r.get(f"closed_form.lda_{clients}_round_s"),
            r.get(f"closed_form.lda_{clients}_peak_mb"),
        )
        first, acc = (r.get(f"closed_form.lda_{clients}_first_round_s"),
                      r.get(f"closed_form.lda_{clients}_final_acc"))  # fmt: skip
        scale.append(f"{clients:,} clients: the statistics round {num(first)} s, the rounds after "
                     f"it {num(s)} s in the median (every client chooses its head in the first "
                     f"of them), peak {num(peak)} MB, final accuracy {pct(acc)}%")  # fmt: skip
    ratio = r.get("closed_form.run_bytes_fedavg_over_lda")
    lines += [
        "",
        f"A device's uplink over a whole 30-round run at the default k = 512: lda "
        f"{num(r.get('closed_form.run_bytes_up_lda'))} bytes, fedavg "
        f"{num(r.get('closed_form.run_bytes_up_fedavg'))} ({num(ratio)} times lda's).",
        "",
        "Under `dp-features`:",
        "",
        closed_form_privacy(r),
        "",
        "On the vector transport with the one-backbone zoo (192 features, no projection), "
        "100 training and 20 test samples a client: " + "; ".join(scale) + ".",
    ]
    return "\n".join(lines)
