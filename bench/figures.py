"""The figures of README.md and docs/, generated from the committed results files.

A generated block in a Markdown file sits between ``<!-- figures:NAME -->`` and
``<!-- /figures:NAME -->``; :data:`BLOCKS` holds one generator per NAME, reading
bench/results.json (``make bench``) and bench/accuracy.json (``make bench-accuracy``).
``make figures`` rewrites every block; ``--check`` only says which differ (a test runs
it). A figure whose section was not measured in the file's run says so: nothing is
carried over from older runs or typed by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FILES = tuple(
    ROOT / name
    for name in (
        "README.md",
        "docs/fleet.md",
        "docs/privacy.md",
        "docs/deploy.md",
        "docs/export.md",
    )
)
SOURCES = (HERE / "results.json", HERE / "accuracy.json")
BLOCK = re.compile(
    r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S
)


@dataclass(frozen=True)
class Results:
    """Every measured key, with the section (and so the run) it comes from."""

    values: dict[str, float]
    section_of: dict[str, str]
    sections: dict[str, dict[str, Any]]

    @classmethod
    def load(cls, paths: tuple[Path, ...] = SOURCES) -> Results:
        values: dict[str, float] = {}
        section_of: dict[str, str] = {}
        sections: dict[str, dict[str, Any]] = {}
        for path in paths:
            if not path.exists():
                continue
            document = json.loads(path.read_text())
            for name, section in document.get("sections", {}).items():
                sections[name] = section
                for key, value in section["results"].items():
                    values[key] = value
                    section_of[key] = name
        return cls(values, section_of, sections)

    def get(self, key: str) -> float | None:
        return self.values.get(key)

    def provenance(self, section: str) -> str:
        """'2026-11-25, commit 1a2b3c4d5e6f, 2 cores (AMD EPYC)' or 'not measured'."""
        s = self.sections.get(section)
        if s is None:
            return "not measured"
        m = s["machine"]
        return f"{s['date'][:10]}, commit {s['commit']}, {m['cores']} cores ({m['cpu']})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _num(value: float | None) -> str:
    if value is None:
        return "not measured"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


# -- accuracy ---------------------------------------------------------------------------------

METHODS = ("solo", "fedavg", "fedproto", "fedpcl", "fpl", "feddbp", "central")
SETTING_NAMES = {"feature": "feature shift", "label": "label shift (alpha 0.5)",
                 "feature-label": "feature & label shift", "glyphs": "glyphs-5"}  # fmt: skip
ACCURACY = "bench.accuracy_bench"


def _final(r: Results, prefix: str) -> str:
    mean, std = r.get(f"{prefix}.final_mean"), r.get(f"{prefix}.final_std")
    return "-" if mean is None else f"{_pct(mean)} ({_pct(std)})"


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
    return f"{_pct(mean)} ({_pct(std)}){at}"


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
TARGETS = (("solo", 1.0), ("fedavg", -3.0), ("fedproto", -2.0))


def targets(r: Results) -> str:
    """FedPCL's margin over each baseline in the fair protocol, against its target."""
    lines = [
        "| setting (fair protocol) | "
        + " | ".join(f"fedpcl - {b} (target {t:+.0f})" for b, t in TARGETS)
        + " |",
        "|---" + "|---:" * len(TARGETS) + "|",
    ]
    for setting in ("feature", "label", "feature-label", "glyphs"):
        mine = r.get(f"accuracy.fair.{setting}.fedpcl.final_mean")
        cells = []
        for baseline, target in TARGETS:
            theirs = r.get(f"accuracy.fair.{setting}.{baseline}.final_mean")
            if mine is None or theirs is None:
                cells.append("not measured")
                continue
            gap = 100 * (mine - theirs)
            cells.append(f"{gap:+.1f} ({'met' if gap >= target - 1e-9 else 'missed'})")
        lines.append(f"| {SETTING_NAMES[setting]} | " + " | ".join(cells) + " |")
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
    for method in ("solo", "fedavg", "fedproto", "fedpcl", "central"):
        cells = [_pct(r.get(f"accuracy.demo.{method}.{d}")) for d in [*domains, "mean"]]
        best, at = (
            r.get(f"accuracy.demo_best.{method}.mean"),
            r.get(f"accuracy.demo_best.{method}.round"),
        )
        cells.append("-" if best is None or at is None else f"{_pct(best)} @ {at:.0f}")
        label = f"{method} (ceiling)" if method == "central" else method
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    seconds = r.get("accuracy.demo.wall_seconds")
    return (
        "```\n"
        + "\n".join(lines)
        + "\n```\n\n"
        + f"(the rows of its table, seed 0; from `make bench-accuracy`: "
        f"{r.provenance(ACCURACY)}; the fleet runs took {_num(seconds)} s in all)"
    )


def comparison(r: Results) -> str:
    """README's summary of the fair comparison under feature shift."""
    get = {m: r.get(f"accuracy.fair.feature.{m}.final_mean") for m in METHODS}
    paper = {m: r.get(f"accuracy.paper.feature.{m}.final_mean") for m in METHODS}
    if any(v is None for v in get.values()):
        return "Not measured: run `make bench-accuracy`."
    return (
        f"Under feature shift, over seeds 0-2, final round (fair protocol): Solo "
        f"{_pct(get['solo'])}, FedAvg {_pct(get['fedavg'])}, FedProto {_pct(get['fedproto'])}, "
        f"FedPCL {_pct(get['fedpcl'])}, FPL {_pct(get['fpl'])}, FedDBP {_pct(get['feddbp'])}; "
        f"one head on the pooled data (the ceiling) {_pct(get['central'])}. Under the paper's "
        f"protocol Solo gives {_pct(paper['solo'])} and FedAvg {_pct(paper['fedavg'])}. "
        f"Measured by `make bench-accuracy`: {r.provenance(ACCURACY)}."
    )


# -- performance ------------------------------------------------------------------------------


def bench_table(r: Results) -> str:
    """Every key of bench/results.json, by section, each section with its run."""
    perf = [n for n in r.sections if n != ACCURACY]
    if not perf:
        return "Not measured: run `make bench`."
    lines = ["| key | value |", "| --- | ---: |"]
    for name in perf:
        section = r.sections[name]
        lines.append(f"| **{name.removeprefix('bench.')}** | {r.provenance(name)} |")
        for key, value in section["results"].items():
            lines.append(f"| `{key}` | {_num(value)} |")
    return "\n".join(lines)


def traffic(r: Results) -> str:
    up = r.get("fleet.bytes_up_per_client_round_fedpcl")
    avg = r.get("fleet.bytes_up_per_client_round_fedavg")
    if up is None or avg is None:
        return "Traffic: not measured (`make bench`)."
    return (
        f"Prototypes cost {up / 1000:.1f} kB per device per round; FedAvg's weights "
        f"{avg / 1000:,.0f} kB (`make bench`: {r.provenance(r.section_of['fleet.bytes_up_per_client_round_fedpcl'])})."
    )


def privacy(r: Results) -> str:
    """What each formal release costs against non-private Solo (bench.privacy_bench)."""
    solo = r.get("privacy.solo_acc")
    if solo is None:
        return "Privacy: not measured (`make bench`)."
    where = r.provenance(r.section_of["privacy.solo_acc"])

    def row(name: str, key: str) -> str:
        acc, diff = r.get(f"{key}_acc"), r.get(f"{key}_minus_solo")
        return f"| {name} | {_pct(acc)} | {'-' if diff is None else f'{diff:+.1f}'} |"

    audits = []
    for label, prefix in (("dp", "privacy.audit"), ("dp-features", "privacy.features_audit")):
        low, claim = r.get(f"{prefix}_eps_lower_bound"), r.get(f"{prefix}_eps_claimed")
        broken = r.get(f"{prefix}_broken_eps_lower_bound")
        if low is not None and claim is not None and broken is not None:
            audits.append(
                f"{label}: empirical lower bound {low:.2f} for a claimed {claim:.2f} "
                f"(a deliberately broken mechanism: {broken:.2f})"
            )
    return "\n".join(
        [
            f"Digits-5 feature shift, 5 devices of 100 training images, 20 rounds, mean of "
            f"seeds 0-2, delta 1e-5, secret noise (`make bench`: {where}):",
            "",
            "| release | final mean accuracy (%) | vs Solo (points) |",
            "| --- | ---: | ---: |",
            f"| Solo, no privacy | {_pct(solo)} | |",
            row("dp-features, epsilon 1", "privacy.features_eps1"),
            row("dp-features, epsilon 8", "privacy.features_eps8"),
            row("dp (DP-SGD), epsilon 8", "privacy.fedpcl_eps8"),
            "",
            "Canary audits, " + "; ".join(audits) + "." if audits else "Audits: not measured.",
        ]
    )


def effnet_fleet(r: Results) -> str:
    """EfficientNet-Lite0 against the glyph zoo in one fleet setting
    (bench.effnet_fleet_bench)."""
    rows = []
    for method in ("fedpcl", "solo", "fedavg"):
        zoo, effnet = (r.get(f"fleet.{n}_feature_{method}_mean") for n in ("zoo", "effnet"))
        if zoo is None or effnet is None:
            return "Not measured: run `make bench`."
        rows.append(f"| {method} | {_pct(zoo)} | {_pct(effnet)} | {100 * (effnet - zoo):+.1f} |")
    where = r.provenance(r.section_of["fleet.effnet_feature_fedpcl_mean"])
    first = (r.get("fleet.zoo_feature_first_run_s"), r.get("fleet.effnet_feature_first_run_s"))
    return "\n".join(
        [
            "Digits-5 feature shift, 5 clients of 100 training and 100 test images, 30 rounds, "
            "seeds 0-2, memory transport, the fair protocol; final accuracy in %, mean over "
            f"seeds (`make bench`: {where}):",
            "",
            "| method | glyph zoo (3 backbones, 896-d) | EfficientNet-Lite0 (1280-d) | difference |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            f"The first run of a seed, which fills the feature cache, took {_num(first[1])} s "
            f"on EfficientNet-Lite0 against {_num(first[0])} s on the zoo.",
        ]
    )


def effnet_export(r: Results) -> str:
    """EfficientNet-Lite0's export figures against their targets (bench.effnet_bench)."""
    key = "export.effnet_lite0_"
    if r.get(key + "int8_cosine") is None:
        return "Not measured: run `make bench`."

    def get(name: str) -> float | None:
        return r.get(key + name)

    def met(value: float | None, target: float, *, below: bool = False) -> str:
        if value is None:
            return "not measured"
        return "met" if (value <= target if below else value >= target) else "missed"

    rows = [
        ("fp32_max_abs_vs_torch", f"{get('fp32_max_abs_vs_torch'):.1e} (features of norm 1)",
         "<= 1e-4", met(get("fp32_max_abs_vs_torch"), 1e-4, below=True)),
        ("ort_fp32_vs_torch", f"{_num(get('ort_fp32_vs_torch'))} (batch 8, the same threads)",
         ">= 1.3", met(get("ort_fp32_vs_torch"), 1.3)),
        ("int8_vs_fp32", f"{_num(get('int8_vs_fp32'))} (median of paired rounds, quartiles "
         f"{_num(get('int8_vs_fp32_q1'))}-{_num(get('int8_vs_fp32_q3'))})",
         ">= 2.0", met(get("int8_vs_fp32"), 2.0)),
        ("int8_cosine", f"{get('int8_cosine'):.4f} on held-out images (worst image "
         f"{get('int8_cosine_worst'):.3f}; digits-5 {get('int8_cosine_digits5'):.3f})",
         ">= 0.995", met(get("int8_cosine"), 0.995)),
        ("fp32_features_per_s", f"{_num(get('fp32_features_per_s'))} digits-5 images/s "
         f"through the agent's runtime (int8 {_num(get('int8_features_per_s'))})", "", ""),
    ]  # fmt: skip
    where = r.provenance(r.section_of[key + "int8_cosine"])
    return "\n".join(
        [f"`make bench`: {where}.", "", "| key | value | target | |", "|---|---|---:|---|"]
        + [
            f"| `{key}{name}` | {value} | {target} | {verdict} |"
            for name, value, target, verdict in rows
        ]
    )


def reliability(r: Results) -> str:
    """The junk drain and flood figures (bench.reliability_bench)."""
    drained = r.get("reliability.junk_drain_per_s")
    if drained is None:
        return "Not measured: run `make bench`."
    where = r.provenance(r.section_of["reliability.junk_drain_per_s"])
    lost = r.get("reliability.flood_honest_lost")
    round_s = r.get("fleet.mqtt_200_round_s")
    return (
        f"A coordinator behind Mosquitto rejects {_num(drained)} junk messages a second "
        f"(paho's own one-packet-at-a-time reader, doing nothing with them: "
        f"{_num(r.get('reliability.paho_drain_per_s'))}); 20,000 junk messages during a round "
        f"cost {_num(lost)} honest updates; a 200-device MQTT fleet closes a round in "
        f"{_num(round_s)} s (`make bench`: {where})."
    )


BLOCKS: dict[str, Callable[[Results], str]] = {
    "effnet-fleet": effnet_fleet,
    "effnet-export": effnet_export,
    "reliability": reliability,
    "privacy": privacy,
    "fair-table": protocol_table("fair"),
    "paper-table": protocol_table("paper"),
    "glyphs-table": glyphs_table,
    "targets": targets,
    "demo": demo,
    "comparison": comparison,
    "bench-table": bench_table,
    "traffic": traffic,
}


def render(text: str, results: Results) -> str:
    """``text`` with every marked block regenerated; an unknown block name is an error."""

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise KeyError(f"no generator for the block figures:{name}")
        return f"{match[1]}{BLOCKS[name](results)}\n{match[4]}"

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; exit 1 naming the files whose blocks differ")  # fmt: skip
    args = parser.parse_args(argv)
    results = Results.load()
    stale = []
    for path in FILES:
        text = path.read_text()
        new = render(text, results)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{'stale' if args.check else 'rewritten'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
