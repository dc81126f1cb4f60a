"""The performance figures: every benchmark key, traffic, privacy, EfficientNet-Lite0
and reliability, each from bench/results.json (``make bench``)."""

from __future__ import annotations

from bench.figure_results import ACCURACY, Results, num, pct


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
            lines.append(f"| `{key}` | {num(value)} |")
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
        return f"| {name} | {pct(acc)} | {'-' if diff is None else f'{diff:+.1f}'} |"

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
            f"| Solo, no privacy | {pct(solo)} | |",
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
        rows.append(f"| {method} | {pct(zoo)} | {pct(effnet)} | {100 * (effnet - zoo):+.1f} |")
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
            f"The first run of a seed, which fills the feature cache, took {num(first[1])} s "
            f"on EfficientNet-Lite0 against {num(first[0])} s on the zoo.",
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
        ("ort_fp32_vs_torch", f"{num(get('ort_fp32_vs_torch'))} (batch 8, the same threads)",
         ">= 1.3", met(get("ort_fp32_vs_torch"), 1.3)),
        ("int8_vs_fp32", f"{num(get('int8_vs_fp32'))} (median of paired rounds, quartiles "
         f"{num(get('int8_vs_fp32_q1'))}-{num(get('int8_vs_fp32_q3'))})",
         ">= 2.0", met(get("int8_vs_fp32"), 2.0)),
        ("int8_cosine", f"{get('int8_cosine'):.4f} on held-out images (worst image "
         f"{get('int8_cosine_worst'):.3f}; digits-5 {get('int8_cosine_digits5'):.3f})",
         ">= 0.995", met(get("int8_cosine"), 0.995)),
        ("fp32_features_per_s", f"{num(get('fp32_features_per_s'))} digits-5 images/s "
         f"through the agent's runtime (int8 {num(get('int8_features_per_s'))})", "", ""),
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
        f"A coordinator behind Mosquitto rejects {num(drained)} junk messages a second "
        f"(paho's own one-packet-at-a-time reader, doing nothing with them: "
        f"{num(r.get('reliability.paho_drain_per_s'))}); 20,000 junk messages during a round "
        f"cost {num(lost)} honest updates; a 200-device MQTT fleet closes a round in "
        f"{num(round_s)} s (`make bench`: {where})."
    )


def database(r: Results) -> str:
    """The coordinator's database after 150 rounds of 100 FedPCL devices, kept whole and
    with keep_rounds = 25 (bench.coordinator_bench)."""
    everything = r.get("coordinator.db_mb_100_clients_150_rounds_keep_all")
    if everything is None:
        return "Not measured: run `make bench`."
    where = r.provenance(r.section_of["coordinator.db_mb_100_clients_150_rounds_keep_all"])
    retained = r.get("coordinator.db_mb_100_clients_150_rounds_keep_25")
    return (
        f"Kept whole, 100 FedPCL devices fill {num(everything)} MB in 150 rounds; with "
        f"`keep_rounds = 25` the file is {num(retained)} MB after the same 150 rounds "
        f"(`coordinator.db_mb_100_clients_150_rounds_*`, `make bench`: {where})."
    )


def restart(r: Results) -> str:
    """Rounds and seconds to a closing round after the database is lost or rolled back
    (bench.restart_bench)."""
    lost = r.get("reliability.db_lost_rounds_to_resume")
    if lost is None:
        return "Not measured: run `make bench`."
    where = r.provenance(r.section_of["reliability.db_lost_rounds_to_resume"])
    return (
        f"With three devices on a real Mosquitto, a coordinator restarted on a deleted "
        f"database closed a round {num(r.get('reliability.db_lost_seconds_to_resume'))} s "
        f"after the restart, within the first {num(lost)} round(s) it opened "
        f"(`reliability.db_lost_rounds_to_resume`); one restarted on a copy "
        f"{num(r.get('reliability.db_rolled_back_rounds_behind'))} rounds behind its devices "
        f"did within {num(r.get('reliability.db_rolled_back_rounds_to_resume'))}, after "
        f"{num(r.get('reliability.db_rolled_back_seconds_to_resume'))} s (`make bench`: "
        f"{where})."
    )


#: The compromised-device settings, as bench/compromised_bench.py names them.
COMPROMISED_SETTINGS = (
    ("defaults", "defaults (count cap, norm clip, direction screen)"),
    ("no_screen", "count cap and norm clip only"),
    ("median", 'defaults, `rule = "median"`'),
    ("trimmed_mean", 'defaults, `rule = "trimmed_mean"`'),
    ("undefended", "no defence"),
)


def _one_of_n_table(
    r: Results, what: str, header: str, fields: tuple[str, str],
    settings: tuple[tuple[str, str], ...], key: str,
) -> list[str]:  # fmt: skip
    """One compromised device at 1 of 3, 10 and 100: per setting, ``key`` (``{n}``,
    ``{name}``, ``{field}``) for each of ``fields``, as ``a / b``."""
    rows = [f"| {what} | 1 of 3: {header} | 1 of 10 | 1 of 100 |", "|---|---|---|---|"]
    for name, label in settings:
        cells = []
        for n in (3, 10, 100):
            a, b = (r.get(key.format(n=n, name=name, field=f)) for f in fields)
            cells.append("-" if a is None else f"{num(a)} / {num(b)}")
        rows.append(f"| {label} | {' | '.join(cells)} |")
    return rows


def compromised(r: Results) -> str:
    """One compromised device against each setting: the largest cosine of a final global
    prototype to its vector and the longest global prototype (bench.compromised_bench)."""
    key = "reliability.compromised_1_of_10_cosine"
    if r.get(key) is None:
        return "Not measured: run `make bench`."
    rows = _one_of_n_table(r, "setting", "cosine / norm", ("cosine", "norm"),
                           COMPROMISED_SETTINGS,
                           "reliability.compromised_1_of_{n}_{name}_{field}")  # fmt: skip
    drop = r.get("reliability.compromised_1_of_10_accuracy_drop")
    return "\n".join([
        *rows, "",
        f"Honest devices' accuracy at 1 of 10 under the defaults: {pct(r.get('reliability.compromised_1_of_10_loud_accuracy'))} "
        f"under attack against {pct(r.get('reliability.compromised_1_of_10_clean_accuracy'))} without "
        f"(a drop of {num(drop)} points; target <= 2, cosine target <= 0.3) (`make bench`: "
        f"{r.provenance(r.section_of[key])}).",
    ])  # fmt: skip


#: The closed-form attacks, as bench/closed_form_attack_bench.py names them.
LDA_ATTACKS = (
    ("label_flip", "labels flipped, counts at `max_samples`"),
    ("label_flip_dp", "the same, claiming noise"),
    ("deleted_classes", "counts of -100,000 on nine classes, claiming noise"),
    ("huge_gram", "second moment 10,000 off the diagonal"),
    ("indefinite_gram", "second moment -1,000 I, claiming noise"),
    ("inflated_counts", "true means at 10,000 samples, no spread"),
)


def lda_attacks(r: Results) -> str:
    """One compromised device against the LDA head: each attack's drop in points under the
    defaults and undefended, at 1 of 3, 10 and 100 (bench.closed_form_attack_bench)."""
    key = "reliability.lda_attack_worst_drop"
    if r.get(key) is None:
        return "Not measured: run `make bench`."
    rows = _one_of_n_table(r, "attack", "defaults / undefended", ("drop", "undefended_drop"),
                           LDA_ATTACKS, "reliability.lda_attack_1_of_{n}_{name}_{field}")  # fmt: skip
    clean = [
        f"{num(r.get(f'reliability.lda_attack_1_of_{n}_clean'))} "
        f"({num(r.get(f'reliability.lda_attack_1_of_{n}_defence_cost'))})"
        for n in (3, 10, 100)
    ]
    return "\n".join([
        *rows, "",
        f"Worst drop at 1 of 10: {num(r.get(key))} points (target <= 2); rounds announced "
        f"without a head: {num(r.get('reliability.lda_attack_headless_rounds'))} (target 0). "
        f"The clean fleet's head at 1 of 3, 10 and 100: {', '.join(clean)} (in brackets: the "
        "points the defences cost it, the pooled head less the capped one) "
        f"(`make bench`: {r.provenance(r.section_of[key])}).",
    ])  # fmt: skip


#: Issue-level targets of the fleet-scale keys: (key, what it is, bound, at most?).
SCALE_TARGETS = (
    ("fleet.bytes_down_per_client_round_fedpcl_1000", "FedPCL bytes down per client and "
     "round, 1,000 clients", 65_536, True),
    ("fleet.bytes_total_fedavg_over_fedpcl", "FedAvg's bytes up + down over FedPCL's, "
     "1,000 clients", 20, False),
    ("fleet.memory_10k_round_s", "seconds per round, 10,000 FedPCL clients (vector "
     "engine)", 60, True),
    ("fleet.memory_10k_peak_mb", "peak MB of that run", 12_000, True),
    ("fleet.speedup_vs_flower", "Flower's seconds per FedAvg round over ProtoFleet's, "
     "1,000 clients", 10, False),
    ("fleet.time_to_ceiling_vs_flower", "Flower's FedAvg seconds to its own final accuracy "
     "over lda's one round, 1,000 clients", 100, False),
    ("fleet.mqtt_1000_round_s", "seconds per round, 1,000 agents over Mosquitto", None, True),
    ("fleet.mqtt_1000_peak_mb", "peak MB of every process of that run", None, True),
    ("fleet.mqtt_1000_lost", "updates missing from the coordinator's database", 0, True),
)  # fmt: skip


def scale(r: Results) -> str:
    """The fleet-scale keys against their targets (bench.vector_bench, mqtt_fleet_bench)."""
    rows = ["| key | what | value | target | |", "|---|---|---:|---:|---|"]
    where: list[str] = []
    for key, what, bound, at_most in SCALE_TARGETS:
        value = r.get(key)
        target = "" if bound is None else f"{'<=' if at_most else '>='} {num(bound)}"
        if value is None:
            verdict = "not measured"
        elif bound is None:
            verdict = ""
        else:
            verdict = "met" if (value <= bound if at_most else value >= bound) else "missed"
        rows.append(f"| `{key}` | {what} | {'-' if value is None else num(value)} | {target} "
                    f"| {verdict} |")  # fmt: skip
        section = r.section_of.get(key)
        if section is not None and section not in where:
            where.append(section)
    runs = "; ".join(f"{s.removeprefix('bench.')}: {r.provenance(s)}" for s in where)
    return "\n".join([f"`make bench` ({runs or 'not run'}).", "", *rows])
