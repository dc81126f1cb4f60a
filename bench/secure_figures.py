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
