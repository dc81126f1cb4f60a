"""A coordinator worker's durable state: SQLite in WAL mode, one file per worker.

It holds every update the worker accepted, as received, keyed by (run, round, client): the
first stored copy wins, as in the coordinator's own store. A worker's partial sum of a
round is recomputed from these rows whenever it is asked for, so after ``kill -9`` and a
restart it is exactly what was committed: nothing lost, nothing counted twice. It also
holds the round the worker last heard announced, so a restarted worker judges the updates
its persistent session redelivers before the retained announcement reaches it again, and
the rounds the combiner has collected, which take no more updates. For closed-form
methods its rows are also where a client's earlier statistics are read back from when
its later ones replace them (:meth:`WorkerStore.update`, coordinator/tier/owner_statistics.py).

Opened as the coordinator's database is (coordinator/storage/schema.py): write-ahead log, NORMAL
sync (survives a process crash; FULL also a power cut), ``quick_check`` on open.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from coordinator.storage.schema import immediate, open_checked

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS updates (
    run TEXT NOT NULL,
    round INTEGER NOT NULL,
    client TEXT NOT NULL,
    digest TEXT NOT NULL,
    stored_at REAL NOT NULL,
    payload BLOB NOT NULL,
    PRIMARY KEY (run, round, client)
);
CREATE TABLE IF NOT EXISTS quarantine (
    run TEXT NOT NULL,
    round INTEGER NOT NULL,
    client TEXT NOT NULL,
    reason TEXT NOT NULL,
    payload BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS collected (
    run TEXT NOT NULL,
    round INTEGER NOT NULL,
    PRIMARY KEY (run, round)
);
"""


@dataclass(frozen=True)
class OpenRound:
    """The round the coordinator last announced, as far as this worker heard it."""

    run: str
    run_started: float
    round: int


@dataclass(frozen=True)
class StoredUpdate:
    client: str
    digest: str
    stored_at: float
    payload: bytes


def connect(path: Path, *, synchronous: str = "NORMAL") -> sqlite3.Connection:
    """The worker database at ``path`` (autocommit: the store begins its own
    transactions), its tables created. sqlite3.Error if it cannot be opened."""
    return open_checked(
        path, synchronous=synchronous, schema=SCHEMA,
        prepare=lambda db: db.execute("PRAGMA journal_mode=WAL"),
    )  # fmt: skip


class WorkerStore:
    """A thread-safe handle on one worker's database."""

    def __init__(self, path: Path, *, synchronous: str = "NORMAL") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = connect(path, synchronous=synchronous)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, immediate(self._db):
            yield self._db

    def bind(self, *, fleet: str, worker: str) -> None:
        """Refuse another fleet's or worker's file: two workers on one database would each
        report the other's updates in their partial sums."""
        with self._transaction() as db:
            for key, value in (("fleet", fleet), ("worker", worker)):
                row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES (?, ?)", (key, value))
                elif row[0] != value:
                    raise ValueError(f"{self.path} is {key} {row[0]!r}'s, not {value!r}'s")

    def add(
        self, *, run: str, round_: int, client: str, digest: str, payload: bytes, now: float
    ) -> str | None:
        """Store one update, committed before this returns; None if it is new, else the
        digest of the copy stored first (which stands)."""
        with self._transaction() as db:
            cursor = db.execute(
                "INSERT OR IGNORE INTO updates VALUES (?, ?, ?, ?, ?, ?)",
                (run, round_, client, digest, now, payload),
            )
            if cursor.rowcount == 1:
                return None
            row = db.execute(
                "SELECT digest FROM updates WHERE run = ? AND round = ? AND client = ?",
                (run, round_, client),
            ).fetchone()
            return str(row[0])

    def updates(self, run: str, round_: int) -> Iterator[StoredUpdate]:
        """The stored updates of a round, by client id."""
        with self._lock:
            rows = self._db.execute(
                "SELECT client, digest, stored_at, payload FROM updates "
                "WHERE run = ? AND round = ? ORDER BY client",
                (run, round_),
            ).fetchall()
        for client, digest, stored_at, payload in rows:
            yield StoredUpdate(client, digest, float(stored_at), bytes(payload))

    def update(self, run: str, round_: int, client: str) -> StoredUpdate | None:
        """The stored update of ``client`` in ``round_`` of ``run``, None if none is."""
        with self._lock:
            row = self._db.execute(
                "SELECT digest, stored_at, payload FROM updates "
                "WHERE run = ? AND round = ? AND client = ?",
                (run, round_, client),
            ).fetchone()
        if row is None:
            return None
        digest, stored_at, payload = row
        return StoredUpdate(client, digest, float(stored_at), bytes(payload))

    def quarantine(self, run: str, round_: int, client: str, reason: str) -> None:
        """Move a stored update that today's checks refuse out of its round, kept with the
        reason (as the coordinator's store keeps its quarantined updates)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO quarantine SELECT run, round, client, ?, payload FROM updates "
                "WHERE run = ? AND round = ? AND client = ?",
                (reason, run, round_, client),
            )
            db.execute(
                "DELETE FROM updates WHERE run = ? AND round = ? AND client = ?",
                (run, round_, client),
            )

    def forget(self, run: str, round_: int) -> None:
        """Drop a round's updates once the combiner has merged it. Not for a closed-form
        fleet's rounds: the owner may ask for a client's statistics back from any earlier
        round, when the client's later ones replace them (nothing calls this yet)."""
        with self._transaction() as db:
            db.execute("DELETE FROM updates WHERE run = ? AND round = ?", (run, round_))

    def mark_collected(self, run: str, round_: int) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO collected VALUES (?, ?)", (run, round_))

    def collected(self, run: str, round_: int) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM collected WHERE run = ? AND round = ?", (run, round_)
            ).fetchone()
        return row is not None

    def save_open_round(self, open_: OpenRound) -> None:
        with self._transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [
                    ("run", open_.run),
                    ("run_started", repr(open_.run_started)),
                    ("round", str(open_.round)),
                ],
            )

    def open_round(self) -> OpenRound | None:
        with self._lock:
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if "run" not in meta:
            return None
        return OpenRound(
            run=meta["run"], run_started=float(meta["run_started"]), round=int(meta["round"])
        )
