"""The words a report states its settings in: what shaped the figures besides the data
(rounds, epochs, transport, [train] settings) and the protocol they were made under."""

from __future__ import annotations

from typing import Any

from coordinator.downlink import DEFAULT_BUDGET
from fleet.transports.protocols import PROTOCOLS


def seeds_of(methods: dict[str, Any]) -> list[str]:
    """Every seed a report's methods ran, sorted."""
    return sorted({s for m in methods.values() for s in m["runs"]})


def settings(config: dict[str, Any], train: dict[str, dict[str, Any]] | None = None) -> str:
    """What shaped the figures besides the data, so that two reports can be told apart
    without their JSON: '30 rounds, 1 local epoch per round, ...', or ''. ``train`` as
    for :func:`train_note`."""
    parts = []
    if "rounds" in config:
        parts.append(f"{config['rounds']} rounds")
    if "epochs" in config:
        parts.append(
            f"{config['epochs']} local epoch{'' if config['epochs'] == 1 else 's'} per round"
        )
    if "out_dim" in config:
        parts.append(f"head output {config['out_dim']}")
    if "transport" in config:
        parts.append(f"{config['transport']} transport")
    if workers := config.get("coordinator_workers"):  # the aggregation differs (docs/fleet.md)
        parts.append(f"coordinator sharded over {workers} worker{'' if workers == 1 else 's'}")
    budget = config.get("downlink_budget", DEFAULT_BUDGET)
    if budget != DEFAULT_BUDGET:  # named when not the deployed default
        parts.append("every local set announced" if budget == 0 else f"downlink {budget:,} bytes")
    if note := train_note(config, train):
        parts.append(note)
    return ", ".join(parts)


def method_train(report: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """Each method's [train] settings in a fleet report, or None in a report that does not
    record them per method."""
    methods = report.get("methods") or {}
    if not methods or not all("train" in m for m in methods.values()):
        return None
    return {name: m["train"] for name, m in methods.items()}


def train_note(config: dict[str, Any], train: dict[str, dict[str, Any]] | None = None) -> str:
    """The [train] settings beyond the agents' defaults, or '': 'train: tau=0.2' for
    those every method had, 'classifier=bounded for solo and fedavg' for those of some
    methods only. ``train`` maps each method to its settings; without it, the
    ``--train-param`` of ``config`` are every method's."""
    if not train:
        train = {"": config.get("train_param") or {}}
    tables = list(train.values())
    common = {k: v for k, v in tables[0].items() if all(k in t and t[k] == v for t in tables)}
    parts = [f"{k}={v}" for k, v in sorted(common.items())]
    some: dict[str, list[str]] = {}
    for name, table in train.items():
        for k, v in sorted(table.items()):
            if k not in common:
                some.setdefault(f"{k}={v}", []).append(name)
    for setting, names in sorted(some.items()):
        listed = ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]
        parts.append(f"{setting} for {listed}")
    return "train: " + ", ".join(parts) if parts else ""


def protocol_line(config: dict[str, Any]) -> str:
    """'Fair protocol: every method ...' for a report made under a --protocol, or ''."""
    chosen = PROTOCOLS.get(config.get("protocol") or "")
    return chosen.summary[0].upper() + chosen.summary[1:] + "." if chosen else ""


def secure_lines(methods: dict[str, Any]) -> list[str]:
    """One sentence per distinct public [secure_aggregation] table among a report's
    methods (``methods[name]["settings"]["secure_aggregation"]``), naming its methods."""
    by_table: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for name, m in methods.items():
        table = (m.get("settings") or {}).get("secure_aggregation")
        if table:
            by_table.setdefault(repr(sorted(table.items())), (table, []))[1].append(name)
    return [_secure_sentence(table, names) for table, names in by_table.values()]


def _secure_sentence(table: dict[str, Any], names: list[str]) -> str:
    noise = (
        f"distributed discrete Gaussian noise for epsilon {table['epsilon']:g} at delta "
        f"{table['delta']:g} over the whole run"
        if table["epsilon"] > 0
        else "no noise"
    )
    graph = (
        "every device each other's neighbour"
        if table["neighbours"] == 0
        else f"{table['neighbours']} neighbours each"
    )
    return (
        f"Secure aggregation ({' and '.join(names)}): the devices' releases reached the "
        f"coordinator only as the fleet's sum, {noise}; threshold {table['threshold']}, "
        f"{table['colluding']} colluding, {graph}, {table['dataset_size']} samples a device "
        f"at most, a {table['bits']}-bit ring at scale {table['scale']:g}."
    )
