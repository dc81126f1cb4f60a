"""Durable coordinator state in SQLite (WAL).

Every accepted update is committed before the broker gets its QoS 1 acknowledgement, and
closing round t is one transaction with opening round t+1, so after ``kill -9`` the
database holds either the open round with the updates already accepted, or the next
round: never a half-closed round or an update counted twice ((round, client) is the
primary key).
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from coordinator.storage.checkpointer import Checkpointer
from coordinator.storage.schema import (
    PAGE_SIZE,
    WAL_CHECKPOINT_BYTES,
    DamagedDatabase,
    connect,
    immediate,
)
from coordinator.storage.store_rows import (
    Commit,
    RoundRow,
    StateError,
    StorageFault,
    corrupt,
    damaged_message,
)

__all__ = ["Commit", "RoundRow", "StateError", "StorageFault", "Store"]
from coordinator.storage.summary import (
    clients_saying,
    on_previous_version,
    read_summary,
    refusing_signature,
)
from protocol.limits import PROTOCOL_VERSION
from protocol.status import UNSUPPORTED_VERSION


class Store:
    """A thread-safe handle on the coordinator database."""

    def __init__(self, path: Path, *, synchronous: str = "NORMAL") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        #: An empty file where the database should be, which a failing disk or a hand
        #: left: a new run begins, said out loud (coordinator/rounds/manager.py).
        self.empty_file = path.exists() and path.stat().st_size == 0
        try:
            self._db = connect(path, synchronous=synchronous)
            self.checkpointer = Checkpointer(path, every_bytes=WAL_CHECKPOINT_BYTES)
        except sqlite3.Error as exc:
            opened = getattr(self, "_db", None)
            if opened is not None:
                with contextlib.suppress(sqlite3.Error):
                    opened.close()
            if isinstance(exc, DamagedDatabase) or corrupt(exc):
                raise StateError(damaged_message(path, exc)) from exc
            raise StateError(f"cannot open coordinator database {path}: {exc}") from exc
        # Re-entrant: a batch (below) holds it across the writes it groups.
        self._lock = threading.RLock()
        self._batching = False
        self._pending = 0  # bytes written by the open transaction, about
        self.path = path

    def close(self) -> None:
        with self._lock:
            self.checkpointer.close()
            self._db.close()

    def _wrote(self, nbytes: int) -> None:
        """Count a payload written in the open transaction, for the checkpointer."""
        self._pending += nbytes

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction (:func:`coordinator.storage.schema.immediate`), or part of the open
        batch's; a commit tells the checkpointer what it wrote."""
        if self._batching:
            yield  # part of the batch's transaction
            return
        # Any commit appends a few pages to the log (a row's, an index's) besides payloads.
        self._pending = 2 * PAGE_SIZE
        with immediate(self._db):
            yield
        self.checkpointer.committed(self._pending)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Every write inside in one transaction (one commit, not one per update): for a
        driver that offers many updates at once. An error or a crash inside loses the
        whole batch, never part of it."""
        with self._lock, self._transaction():
            self._batching = True
            try:
                yield
            finally:
                self._batching = False

    def _one(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        row = self._db.execute(sql, args).fetchone()
        return None if row is None else row[0]

    def bind_identity(self, identity: dict[str, str]) -> None:
        """Record which fleet this database belongs to, or check it matches."""
        with self._lock:
            stored = self._one("SELECT value FROM meta WHERE key = 'identity'")
            if stored is None:
                self._db.execute(
                    "INSERT INTO meta VALUES ('identity', ?)",
                    (json.dumps(identity, sort_keys=True),),
                )
                return
            old = json.loads(stored)
            if old != identity:
                changed = sorted(
                    k for k in set(old) | set(identity) if old.get(k) != identity.get(k)
                )
                raise StateError(
                    f"{self.path} holds state for {old}; the configuration now says {identity} "
                    f"(changed: {', '.join(changed)}). Use a new state_dir for a new fleet, "
                    "method, bundle or basis."
                )

    def run(self, *, now: float | None = None) -> tuple[str, float]:
        """(id, start in Unix seconds) of this database's run, drawn and stamped with
        ``now`` (the clock's time by default) when the database is new. Devices follow one
        run and adopt another only when it started later (protocol/announcement.py); signed
        updates name the id, so one from an earlier database cannot be replayed into this."""
        with self._lock:
            run = self._one("SELECT value FROM meta WHERE key = 'run'")
            started = self._one("SELECT value FROM meta WHERE key = 'run_started'")
            if run is None or started is None:
                run_is_new = run is None
                with self._transaction():
                    if run is None:
                        run = secrets.token_hex(8)
                        self._db.execute("INSERT INTO meta VALUES ('run', ?)", (run,))
                    # A run kept from before runs were dated starts at the epoch: any run
                    # begun since is later.
                    fresh = run_is_new
                    started = repr(time.time() if now is None else now) if fresh else "0"
                    self._db.execute("INSERT INTO meta VALUES ('run_started', ?)", (started,))
            return str(run), float(started)

    def latest_round(self) -> RoundRow | None:
        with self._lock:
            row = self._db.execute(
                "SELECT round, opened_at, deadline, closed_at, announcement, extensions "
                "FROM rounds ORDER BY round DESC LIMIT 1"
            ).fetchone()
        return (
            None
            if row is None
            else RoundRow(row[0], row[1], row[2], row[3], bytes(row[4]), int(row[5]))
        )

    def open_first_round(self, announcement: bytes, *, opened_at: float, deadline: float) -> None:
        with self._lock, self._transaction():
            self._db.execute(
                "INSERT INTO rounds (round, opened_at, deadline, announcement) VALUES (0, ?, ?, ?)",
                (opened_at, deadline, announcement),
            )
            self._wrote(len(announcement))

    def extend_deadline(self, round_: int, deadline: float, announcement: bytes) -> None:
        with self._lock, self._transaction():
            self._db.execute(
                "UPDATE rounds SET deadline = ?, announcement = ?, extensions = extensions + 1 "
                "WHERE round = ?",
                (deadline, announcement, round_),
            )
            self._wrote(len(announcement))

    def add_update(self, round_: int, client: str, payload: bytes, *, received_at: float) -> bool:
        """Store an accepted update; False if (round, client) already has one. The client's
        running tally (last round, updates accepted) moves in the same transaction, and
        outlives the payloads that ``keep_rounds`` drops."""
        with self._lock, self._transaction():
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO updates (round, client, received_at, payload) VALUES (?, ?, ?, ?)",
                (round_, client, received_at, payload),
            )
            added = cursor.rowcount == 1
            if added:
                self._wrote(len(payload))
                self._db.execute(
                    "INSERT INTO contributions VALUES (?, ?, ?, 1) ON CONFLICT (client) DO UPDATE "
                    "SET last_round = MAX(last_round, excluded.last_round), "
                    "last_at = excluded.last_at, updates = updates + 1",
                    (client, round_, received_at),
                )
            return added

    def quarantine(self, round_: int, client: str, reason: str) -> None:
        """Move a stored update that fails today's admission checks out of its round, kept
        aside for a look by hand; counted as a rejection ``quarantined_<reason>``."""
        with self._lock, self._transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO quarantine "
                "SELECT round, client, received_at, payload, ? FROM updates "
                "WHERE round = ? AND client = ?",
                (reason, round_, client),
            )
            self._db.execute("DELETE FROM updates WHERE round = ? AND client = ?", (round_, client))
            self._db.execute(
                "INSERT INTO rejections VALUES (?, 1) "
                "ON CONFLICT (reason) DO UPDATE SET count = count + 1",
                (f"quarantined_{reason}",),
            )

    def updates(self, round_: int) -> list[tuple[str, bytes]]:
        # In client order, not arrival order: float sums depend on their order, and a
        # round's aggregate must not depend on which device happened to answer first.
        with self._lock:
            rows = self._db.execute(
                "SELECT client, payload FROM updates WHERE round = ? ORDER BY client",
                (round_,),
            ).fetchall()
        return [(client, bytes(payload)) for client, payload in rows]

    def update_clients(self, round_: int) -> list[str]:
        """The clients with a stored update in ``round_``, in client order (as :meth:`updates`)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT client FROM updates WHERE round = ? ORDER BY client", (round_,)
            ).fetchall()
        return [client for (client,) in rows]

    def update_payload(self, round_: int, client: str) -> bytes:
        with self._lock:
            payload = self._one(
                "SELECT payload FROM updates WHERE round = ? AND client = ?", (round_, client)
            )
        if payload is None:
            raise LookupError(f"no stored update of {client} in round {round_}")
        return bytes(payload)

    def arrival_times(self, round_: int) -> list[float]:
        with self._lock:
            rows = self._db.execute(
                "SELECT received_at FROM updates WHERE round = ? ORDER BY received_at", (round_,)
            ).fetchall()
        return [r[0] for r in rows]

    def advance(self, commit: Commit) -> None:
        """Close round ``commit.closed`` and open the next one atomically (:class:`Commit`
        says what else the same transaction writes)."""
        closed = commit.closed
        with self._lock, self._transaction():
            for key, value in commit.meta.items():
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
            for client in commit.statistics:
                self._db.execute(
                    "INSERT OR REPLACE INTO statistics (client, round, payload) "
                    "SELECT client, round, payload FROM updates WHERE round = ? AND client = ?",
                    (closed, client),
                )
            self._db.execute(
                "UPDATE rounds SET closed_at = ? WHERE round = ?", (commit.closed_at, closed)
            )
            self._db.execute(
                "INSERT INTO rounds (round, opened_at, deadline, closed_at, announcement) "
                "VALUES (?, ?, ?, ?, ?)",
                (
                    commit.opens,
                    commit.closed_at,
                    commit.deadline,
                    commit.closed_at if commit.final else None,
                    commit.announcement,
                ),
            )
            self._wrote(len(commit.announcement))
            if commit.keep_rounds > 0:
                oldest_kept = closed - commit.keep_rounds + 1
                self._db.execute("DELETE FROM updates WHERE round < ?", (oldest_kept,))
                self._db.execute(
                    "UPDATE rounds SET announcement = X'' "
                    "WHERE round < ? AND length(announcement) > 0",
                    (oldest_kept,),
                )

    def meta_value(self, key: str) -> str | None:
        """The meta table's value of ``key`` (None when unset)."""
        with self._lock:
            value = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        return None if value is None else str(value)

    def statistics_clients(self) -> list[str]:
        """The clients whose statistics the statistics table holds, in client order."""
        with self._lock:
            rows = self._db.execute("SELECT client FROM statistics ORDER BY client").fetchall()
        return [client for (client,) in rows]

    def statistics_of(self, client: str) -> bytes:
        """``client``'s latest statistics-bearing update (LookupError if none)."""
        with self._lock:
            payload = self._one("SELECT payload FROM statistics WHERE client = ?", (client,))
        if payload is None:
            raise LookupError(f"no statistics of {client}")
        return bytes(payload)

    def forget(self, client: str) -> bool:
        """Drop ``client``'s statistics (``edge-coordinator forget``): its row of the
        statistics table, and its update in the open round set aside (quarantined as
        ``forgotten``) so that a resume does not sum it again. False when neither was
        held. The running coordinator drops them from its sum on its next start or
        reload, which rebuilds the sum from the table."""
        latest = self.latest_round()
        with self._lock, self._transaction():
            gone = self._db.execute("DELETE FROM statistics WHERE client = ?", (client,)).rowcount
        held = latest is not None and client in self.update_clients(latest.round)
        if held:
            assert latest is not None
            self.quarantine(latest.round, client, "forgotten")
        return bool(gone) or held

    def record_status(
        self,
        client: str,
        *,
        state: str,
        version: str,
        last_round: int | None,
        reason: str,
        at: float,
        protocol: int = PROTOCOL_VERSION,
    ) -> None:
        """``protocol``: the protocol version the status came in."""
        with self._lock, self._transaction():
            self._db.execute(
                "INSERT INTO clients (client, state, version, last_round, reason, updated_at, "
                "protocol) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (client) DO UPDATE SET "
                "state = excluded.state, version = excluded.version, last_round = excluded.last_round, "
                "reason = excluded.reason, updated_at = excluded.updated_at, "
                "protocol = excluded.protocol",
                (client, state, version, last_round, reason, at, protocol),
            )

    def online_count(self, *, since: float = -math.inf) -> int:
        """Clients whose last status is online and was received after ``since``."""
        with self._lock:
            return int(
                self._one(
                    "SELECT COUNT(*) FROM clients WHERE state = 'online' AND updated_at > ?",
                    (since,),
                )
            )

    def refusing_signature(self, *, since: float = -math.inf) -> list[str]:
        """Online clients that refuse this coordinator's signature (coordinator/storage/summary.py)."""
        with self._lock:
            return refusing_signature(self._db, since=since)

    def unsupported_version(self, *, since: float = -math.inf) -> list[str]:
        """Online clients that cannot read this coordinator's announcements' protocol
        version (coordinator/storage/summary.py)."""
        with self._lock:
            return clients_saying(self._db, UNSUPPORTED_VERSION, since=since)

    def previous_version(self) -> list[str]:
        """Clients whose last status came in an older protocol version than this one's."""
        with self._lock:
            return on_previous_version(self._db)

    def contributors(self) -> set[str]:
        """Every client that ever had an update accepted."""
        with self._lock:
            return {row[0] for row in self._db.execute("SELECT client FROM contributions")}

    def count_rejections(self, counts: Mapping[str, int]) -> None:
        """Add rejection counts (by reason) in one transaction."""
        with self._lock, self._transaction():
            self._db.executemany(
                "INSERT INTO rejections VALUES (?, ?) "
                "ON CONFLICT (reason) DO UPDATE SET count = count + excluded.count",
                sorted(counts.items()),
            )

    def summary(self, *, online_since: float = -math.inf) -> dict[str, Any]:
        """Everything ``edge-coordinator status`` prints, read in one snapshot; a client
        counts as online if its last status says so and came after ``online_since``."""
        with self._lock:
            return read_summary(self._db, online_since=online_since)
