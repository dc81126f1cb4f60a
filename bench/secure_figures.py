"""The secure-aggregation blocks of README.md and docs/: accuracy against each device's own
noise and a trusted curator's (bench.secagg_bench), and what a secure round costs and how
it scales (bench.secagg_cost_bench)."""

from __future__ import annotations

from bench.figure_results import Results, num, pct


def secure_aggregation(r: Results) -> str:
    """Each device noising its own statistics against the distributed discrete Gaussian
    on the secure sum, a one-shot LDA at 1,000 devices (bench.secagg_bench)."""
    key = "privacy.secagg_1000_eps1_acc"
    if r.get(key) is None:
        return "Not measured: run `make bench`."

    def cells(prefix: str, names: tuple[str, ...]) -> str:
        return " | ".join(pct(r.get(f"privacy.{prefix}_1000_{n}_acc")) for n in names)

    rows = [
        "| release (best k of each, fair protocol) | epsilon 1 | epsilon 8 | epsilon 1000 |",
        "|---|---:|---:|---:|",
        f"| each device noises its own (`dp-features`) | {cells('local', ('eps1', 'eps8'))} | |",
        f"| distributed discrete Gaussian, secure sum | {cells('secagg', ('eps1', 'eps8', 'eps1000'))} |",
    ]
    if r.get("privacy.central_1000_eps1_acc") is not None:
        rows.append("| the same noise on the exact sum (a trusted curator's) | "
                    f"{cells('central', ('eps1', 'eps8', 'eps1000'))} |")  # fmt: skip
    rows += [
        "",
        "| without noise, or noise of the quantiser's order | accuracy |",
        "|---|---:|",
        f"| exact sum | {pct(r.get('privacy.secagg_1000_exact_acc'))} |",
        f"| secure sum, noise off | {pct(r.get('privacy.secagg_1000_noise_off_acc'))} |",
    ]
    guard = r.get("privacy.secagg_1000_eps1e7_acc")
    if guard is not None:  # the regression guard: noise that costs nothing
        rows.append(f"| secure sum at epsilon 10^7 (the guard) | {pct(guard)} |")
    error = r.get("privacy.secagg_1000_noise_off_max_error")
    bound = r.get("privacy.secagg_1000_noise_off_bound")
    return "\n".join([
        *rows, "",
        f"Noise off, the decoded sum is within {num(error)} of the exact one per coordinate "
        f"(bound {num(bound)}). Targets: epsilon 1 >= 70 and >= the local release + 20 "
        f"(`make bench`: {r.provenance(r.section_of[key])}).",
    ])  # fmt: skip


def secure_cost(r: Results) -> str:
    """What a secure round costs over Mosquitto with real agents (bench.secagg_cost_bench)."""
    key = "fleet.secagg_bytes_per_device"
    if r.get(key) is None:
        return "Not measured: run `make bench`."
    devices = r.get("fleet.secagg_devices")
    rows = ["| key | value |", "|---|---:|"]
    for name, what in (
        ("fleet.secagg_bytes_per_device", "bytes per device, up and down, one secure round"),
        ("fleet.secagg_seconds", "seconds of the secure round at the coordinator"),
        ("fleet.secagg_vector_length", "values in each device's statistics vector"),
        ("fleet.secagg_neighbours", "neighbours each device pairs with"),
    ):
        value = r.get(name)
        shown = f"{int(value):,}" if value is not None and value == int(value) else num(value)
        rows.append(f"| `{name}`: {what} | {shown} |")
    return "\n".join([
        f"{int(devices or 0)} real agents over Mosquitto, lda:", "", *rows, "",
        f"(`make bench`: {r.provenance(r.section_of[key])}).",
    ])  # fmt: skip


def secure_scale(r: Results) -> str:
    """A secure round's cost at 100 agents, measured, and at 1,000 and 10,000 devices,
    derived (bench.secagg_cost_bench)."""
    key = "fleet.secagg_bytes_per_device"
    if r.get(key) is None:
        return "Not measured: run `make bench`."

    def kb(name: str) -> str:
        value = r.get(name)
        return "-" if value is None else f"{value / 1000:,.0f} kB"

    def gb(name: str) -> str:
        value = r.get(name)
        return "-" if value is None else f"{value / 1e9:,.1f} GB"

    def secs(name: str) -> str:
        value = r.get(name)
        return "-" if value is None else f"{value:,.1f} s"

    rows = [
        "| devices | graph | bytes per device | through the broker | seconds |",
        "|---:|---|---:|---:|---:|",
        f"| 100 (measured) | complete | {kb(key)} | "
        f"{(r.get(key) or 0) * 100 / 1e6:,.1f} MB | {secs('fleet.secagg_seconds')} (2 shared cores) |",
    ]
    for n in (1000, 10_000):
        rows.append(
            f"| {n:,} (derived) | complete | {kb(f'fleet.secagg_bytes_per_device_{n}_derived')} | "
            f"{gb(f'fleet.secagg_broker_bytes_{n}_derived')} | "
            f"{secs(f'fleet.secagg_seconds_{n}_derived')} of compute |"
        )
    for n, k in ((1000, 100), (10_000, 200)):
        rows.append(
            f"| {n:,} (derived) | SecAgg+, {k} neighbours | "
            f"{kb(f'fleet.secagg_plus_bytes_per_device_{n}_derived')} | | |"
        )
    return "\n".join([
        *rows, "",
        f"Slopes: {num(r.get('fleet.secagg_bytes_slope_per_device'))} bytes per device per "
        f"added device on the complete graph; SecAgg+ "
        f"{num(r.get('fleet.secagg_plus_bytes_per_id'))} per device (the roster's and "
        f"survivors' ids) and {num(r.get('fleet.secagg_plus_bytes_per_neighbour'))} per "
        f"neighbour (`make bench`: {r.provenance(r.section_of[key])}).",
    ])  # fmt: skip


#: The in-memory rounds of bench.secagg_scale_bench: (key name, devices, graph).
SCALE_RUNS = (
    ("secaggplus_1000", 1000, "SecAgg+, 100 neighbours"),
    ("secagg_complete_1000", 1000, "complete"),
    ("secaggplus_10000", 10_000, "SecAgg+, 200 neighbours"),
)


def secure_memory(r: Results) -> str:
    """The real protocol in memory at 1,000 and 10,000 devices (bench.secagg_scale_bench)."""
    measured = [run for run in SCALE_RUNS if r.get(f"fleet.{run[0]}_bytes_per_device") is not None]
    if not measured:
        return "Not measured: run `make bench`."
    rows = [
        "| devices | graph | T / t / c | bytes per device (mean, max) | coordinator CPU | a device's CPU | evidence |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for name, devices, graph in measured:

        def get(what: str, name: str = name) -> float:
            return r.get(f"fleet.{name}_{what}") or 0.0

        draws = int(get("evidence_draws"))
        evidence = f"{draws} entries drawn" if draws else "every signature"
        rows.append(
            f"| {devices:,} | {graph} | {int(get('quorum')):,} / {int(get('threshold'))} / "
            f"{int(get('colluding'))} | {get('bytes_per_device') / 1000:,.0f} kB, "
            f"{get('bytes_per_device_max') / 1000:,.0f} kB | {get('seconds'):,.1f} s | "
            f"{get('device_seconds'):,.2f} s | {evidence} |"
        )
    verdicts = []
    for key, bound, unit, at_most in (
        ("fleet.secaggplus_1000_bytes_per_device", 500_000, "bytes", True),
        ("fleet.secaggplus_10000_bytes_per_device", 500_000, "bytes", True),
        ("fleet.secaggplus_10000_seconds", 60.0, "s", True),
    ):
        value = r.get(key)
        if value is not None:
            met = value <= bound if at_most else value >= bound
            verdicts.append(f"`{key}` {num(value)} (target <= {num(bound)} {unit}: "
                            f"{'met' if met else 'missed'})")  # fmt: skip
    first = r.section_of[f"fleet.{measured[0][0]}_bytes_per_device"]
    return "\n".join([
        *rows, "",
        "; ".join(verdicts) + f" (`make bench`: {r.provenance(first)}).",
    ])  # fmt: skip


def secure_broker(r: Results) -> str:
    """A SecAgg+ round of real agents over Mosquitto beside the same round in memory
    (bench.secagg_cost_bench)."""
    names = [k for k in r.values if k.startswith("fleet.secaggplus_mosquitto_")
             and k.endswith("_bytes_per_device")]  # fmt: skip
    if not names:
        return "Not measured: run `make bench`."
    key = names[0]
    base = key.removesuffix("_bytes_per_device")
    devices = int(base.rsplit("_", 1)[1])

    def get(what: str) -> float:
        return r.get(f"{base}_{what}") or 0.0

    return "\n".join([
        "| agents | graph | T / t / c | bytes per device over Mosquitto (mean, max) | in memory | ratio | coordinator's round |",
        "|---:|---|---|---:|---:|---:|---:|",
        f"| {devices:,} | SecAgg+, {int(get('neighbours'))} neighbours | {int(get('quorum'))} / "
        f"{int(get('threshold'))} / {int(get('colluding'))} | {get('bytes_per_device') / 1000:,.1f} kB, "
        f"{get('bytes_per_device_max') / 1000:,.1f} kB | {get('bytes_in_memory') / 1000:,.1f} kB | "
        f"{get('bytes_ratio'):.3f} | {get('seconds'):,.1f} s (2 shared cores) |",
        "",
        f"{int(get('survivors'))} of {devices} survived; {int(get('recorded'))} recorded their "
        f"traffic (`make bench`: {r.provenance(r.section_of[key])}).",
    ])  # fmt: skip


def secure_rule(r: Results) -> str:
    """lda at 1,000 and 10,000 devices under the public projection rule, beside the best k
    picked on the test set (bench.secagg_fleet_bench, bench.projection_rule_bench)."""
    key = "privacy.secagg_10000_eps1_acc"
    if r.get(key) is None:
        return "Not measured: run `make bench`."
    rows = [
        "| fleet | k (the rule's, epsilon 1) | exact | exact, epsilon 1's floor | epsilon 8 | "
        "epsilon 1 | curator's, epsilon 1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for devices, tail in ((1000, "_public_rule"), (10_000, "")):

        def acc(name: str, devices: int = devices, tail: str = tail) -> str:
            return pct(r.get(f"privacy.{name.format(n=devices)}{tail}"))

        k = r.get(f"privacy.secagg_{devices}_rule_k_eps1")
        rows.append(
            f"| {devices:,} x 20, public basis, public rule | {int(k or 0)} | "
            f"{acc('secagg_{n}_exact_acc')} | "
            f"{acc('secagg_{n}_exact_floor_eps1_acc')} | {acc('secagg_{n}_eps8_acc')} | "
            f"{acc('secagg_{n}_eps1_acc')} | {acc('central_{n}_eps1_acc')} |"
        )
        if r.get(f"privacy.secagg_{devices}_random_eps1_acc") is not None:
            rows.append(
                f"| {devices:,} x 20, random projection, public rule | | "
                f"{pct(r.get(f'privacy.secagg_{devices}_random_exact_acc'))} | | | "
                f"{pct(r.get(f'privacy.secagg_{devices}_random_eps1_acc'))} | "
                f"{pct(r.get(f'privacy.secagg_{devices}_random_central_eps1_acc'))} |"
            )
    rows.append(
        "| 10,000 x 20, public basis, best k of 128-512 on the test set | | "
        + pct(r.get("privacy.secagg_10000_best_k_exact_acc")) + " | | "
        + " | ".join(pct(r.get(f"privacy.secagg_10000_best_k_{n}_acc"))
                     for n in ("eps8", "eps1")) + " | |"
    )  # fmt: skip
    gap = r.get("privacy.secagg_10000_eps1_gap")
    derived = ""
    for head, what in (("public_rule_basis_", "in a public basis"),
                       ("public_rule_", "in the random projection")):  # fmt: skip
        rule = r.get(f"privacy.{head}ratio")
        derived += "" if rule is None else (
            f" The rule's ratio {what}, derived on synthetic data: {num(rule)} (mean loss "
            f"against each setting's best k {pct(r.get(f'privacy.{head}mean_regret'))} points, "
            f"worst {pct(r.get(f'privacy.{head}max_regret'))}; "
            f"{r.provenance(r.section_of[f'privacy.{head}ratio'])})."
        )  # fmt: skip
    at_1000 = r.get("privacy.secagg_1000_eps1_acc_public_rule")
    return "\n".join([
        *rows, "",
        f"Epsilon 1 at 10,000 devices: {num(gap)} points under the exact head (target within "
        f"5: {'met' if gap is not None and gap <= 5 else 'missed'}; moonshot within 3: "
        f"{'met' if gap is not None and gap <= 3 else 'missed'}); at 1,000, "
        f"{pct(at_1000)} (target >= 72: "
        f"{'met' if at_1000 is not None and at_1000 >= 0.72 else 'missed'}) "
        f"(`make bench`: {r.provenance(r.section_of[key])}).{derived}",
    ])  # fmt: skip
