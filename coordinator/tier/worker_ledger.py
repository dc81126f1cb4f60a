"""The workers' record in the coordinator's database and metrics: each worker's share
of the intake, round by round, for ``edge-coordinator status`` and the alert on a worker
that stops answering (coordinator/tier/owner.py writes it)."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from coordinator.storage.schema import immediate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """One worker's part in a closed round: the clients its first partial held (its share
    of the intake), those its final partial counted, and when it answered."""

    worker: str
    held: int
    counted: int
    answered_at: float


class WorkerLedger:
    """The ``worker_partials`` table of the coordinator's database (coordinator/storage/schema.py),
    on a connection of its own: coordinator/storage/store.py's is not shared. Written after the
    round's close commits; a crash between the two loses one round's shares, no state."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def record(self, round_: int, answers: Iterable[Answer], *, keep_rounds: int) -> None:
        with self._lock, immediate(self._db):
            self._db.executemany(
                "INSERT OR REPLACE INTO worker_partials VALUES (?, ?, ?, ?, ?)",
                [(round_, a.worker, a.held, a.counted, a.answered_at) for a in answers],
            )
            if keep_rounds > 0:
                self._db.execute(
                    "DELETE FROM worker_partials WHERE round <= ?", (round_ - keep_rounds,)
                )


def worker_summary(path: Path, members: Iterable[str]) -> list[dict[str, Any]]:
    """For ``edge-coordinator status``: each worker's last answered round and its share of
    the intake, in that round and over the rounds the database keeps."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT round, worker, held, counted, answered_at FROM worker_partials"
        ).fetchall()
    finally:
        db.close()
    last = max((r[0] for r in rows), default=None)
    held_last = sum(r[2] for r in rows if r[0] == last)
    held_all = sum(r[2] for r in rows)
    out = []
    for name in members:
        mine = [r for r in rows if r[1] == name]
        latest = max(mine, default=None)
        in_last = sum(r[2] for r in mine if r[0] == last)
        out.append(
            {
                "worker": name,
                "last_round": None if latest is None else latest[0],
                "last_answered_at": None if latest is None else latest[4],
                "held_last_round": in_last,
                "share_last_round": in_last / held_last if held_last else None,
                "share_kept_rounds": sum(r[2] for r in mine) / held_all if held_all else None,
            }
        )
    return out


class WorkerMetrics:
    """Per-worker gauges, on the coordinator's registry (made once per process: a reload
    builds a new owner on the same registry). ``unanswered_seconds`` is what the alert on a
    worker that stops answering watches."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.held = Gauge(
            "protofleet_worker_updates",
            "Clients a worker's partial held in the last collected round (its share)",
            ["worker"],
            registry=registry,
        )
        self.answered = Gauge(
            "protofleet_worker_last_answer_timestamp_seconds",
            "When a worker last answered a collect request (Unix seconds)",
            ["worker"],
            registry=registry,
        )
        self.unanswered = Gauge(
            "protofleet_worker_unanswered_seconds",
            "Seconds a worker has left the open collect request unanswered (0: answered)",
            ["worker"],
            registry=registry,
        )
        self.refused = Counter(
            "protofleet_worker_partials_refused",
            "Partial sums the owner refused unread: malformed, or wrong_shape (not the "
            "fleet's classes, dimensions or statistics: a worker on another configuration)",
            ["reason"],
            registry=registry,
        )
