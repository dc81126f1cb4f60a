"""A finished run read back: every agent's per-round record from its state directory, and
the rounds' times from the coordinator's store."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.config import database_in
from coordinator.storage.store_reader import StoreReader
from edge_agent.state import StateDir
from fleet.data.partition import Partition
from fleet.transports.spec import ClientRecord, RunResult, RunSpec
from runtime.cliutil import CommandFailed


def collect(spec: RunSpec, partition: Partition, *, peak_mb: float, wall: float) -> RunResult:
    """Read the run back from every agent's state and the coordinator's database."""
    return RunResult(spec=spec, clients=client_records(spec, partition),
                     round_seconds=round_seconds(spec), peak_mb=peak_mb,
                     wall_seconds=wall)  # fmt: skip


def client_records(spec: RunSpec, partition: Partition) -> tuple[ClientRecord, ...]:
    """Every agent's per-round record, read through the agent's own state reader."""
    records = []
    for client in partition.clients:
        folder = spec.layout.agent_state(client.name)
        try:
            snapshot = StateDir(folder, agent_id=client.name, create=False).snapshot
        except (OSError, ValueError) as exc:  # unreadable, damaged, or another agent's
            raise CommandFailed(f"no record of {client.name}: {exc}") from exc
        if snapshot.bundle_id is None:  # an agent commits its bundle's id as it starts
            raise CommandFailed(f"no record of {client.name}: no agent state in {folder}")
        by_round = {h["round"]: h for h in snapshot.history}
        rows = [by_round.get(r, {}) for r in range(spec.rounds)]
        records.append(
            ClientRecord(
                name=client.name,
                domain=client.domain,
                accuracy=tuple(h.get("test_accuracy") for h in rows),
                accuracy_prototype=tuple(h.get("test_accuracy_prototype") for h in rows),
                accuracy_classifier=tuple(h.get("test_accuracy_classifier") for h in rows),
                bytes_up=tuple(_traffic(h, "up") for h in rows),
                bytes_down=tuple(_traffic(h, "down") for h in rows),
            )
        )
    return tuple(records)


def _traffic(record: Mapping[str, Any], way: str) -> int:
    """A round's bytes ``way`` (up or down): its update and announcement, and in a secure
    fleet the secure-aggregation stages' messages, which carry its statistics instead."""
    return sum(int(record.get(key) or 0) for key in (f"bytes_{way}", f"secagg_bytes_{way}"))


def run_database(spec: RunSpec) -> Path:
    """The coordinator database of a finished run."""
    database = database_in(spec.layout.coordinator)
    if not database.is_file():
        raise CommandFailed(f"no coordinator database at {database}")
    return database


def round_seconds(spec: RunSpec) -> tuple[float, ...]:
    """Each round's wall time, from the coordinator's database."""
    with StoreReader(run_database(spec)) as store:
        rows = store.round_times(before=spec.rounds)
    # A round's wall time runs from its announcement to the next one (closing = opening).
    opened = {r: t for r, t, _ in rows}
    seconds = []
    for r, t, closed in rows:
        end = closed if closed is not None else opened.get(r + 1)
        seconds.append(float(end - t) if end is not None else float("nan"))
    return tuple(seconds)
