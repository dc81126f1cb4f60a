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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.checkpointer import Checkpointer
from coordinator.schema import BACKFILL, CLIENT_FIELDS, SCHEMA
from runtime.cliutil import CommandFailed


class StateError(RuntimeError):
    """The state directory belongs to another fleet or is unreadable."""


class StorageFault(CommandFailed):
    """The database cannot be written (a full disk, an I/O error). The coordinator stops
    taking updates and exits non-zero; systemd restarts it, and an update it had not yet
    stored was never acknowledged, so the broker delivers it again."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(
            f"storage error: {cause}; stopped taking updates (an unstored update is "
            "delivered again after the restart)"
        )


@dataclass(frozen=True)
class RoundRow:
    round: int
    opened_at: float
    deadline: float
    closed_at: float | None
    announcement: bytes
    extensions: int = 0


#: Bytes per database page, and the write-ahead log's checkpoint size.
PAGE_SIZE = 16_384
WAL_CHECKPOINT_BYTES = 4 << 20
#: Past this the writer checkpoints itself, as a backstop should the checkpointer (below)
#: fall behind: the log of a 4 MB disk's database must not outgrow the disk unnoticed.
WAL_BACKSTOP_BYTES = 64 << 20


class Store:
    """A thread-safe handle on the coordinator database."""

    def __init__(
        self, path: Path, *, synchronous: str = "NORMAL", keep_payloads: bool = True
    ) -> None:
        """``keep_payloads=False``: an accepted update is stored as its row (round, client,
        arrival, the client's tally) with an empty payload. For the simulator's vector run,
        which cannot resume and aggregates what it decoded on arrival: it would otherwise
        write every FedAvg model of every round to disk for nobody to read (0.2 GB a round
        at 1,000 clients). Reading such an update back raises :class:`StateError`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.keep_payloads = keep_payloads
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            # Larger pages for a table of large BLOBs (an update is 5 kB to 1.3 MB): at the
            # default 4 KiB a FedAvg update spans dozens of chained overflow pages, and a
            # round of them wrote in 0.95 s against 0.53 s at 16 KiB (1,000 x 208 kB, WAL,
            # development machine). Not larger: 64 KiB pages (0.43 s) made every small
            # write cost a whole page, and a coordinator on a 4 MB disk ran out of it
            # (tests/test_storage_faults.py). Takes effect on a new database only.
            self._db.execute(f"PRAGMA page_size={PAGE_SIZE}")
            self._db.execute("PRAGMA journal_mode=WAL")
            # The log is folded back past about 4 MiB, as with SQLite's default pages (its
            # default, 1,000 pages, would let it reach 16 MiB on a small disk), by the
            # checkpointer's thread; the writer's own checkpoint is only the backstop.
            self._db.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_BYTES // PAGE_SIZE}")
            # A log that a burst grew is cut back once it starts afresh: the file must not
            # keep its largest size on a small disk.
            self._db.execute(f"PRAGMA journal_size_limit={2 * WAL_CHECKPOINT_BYTES}")
            # NORMAL in WAL mode survives a process crash (kill -9); FULL also a power cut.
            self._db.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'FULL' else 'NORMAL'}")
            self._db.executescript(SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(rounds)")}
            if "extensions" not in columns:  # a database from before deadline extensions counted
                self._db.execute(
                    "ALTER TABLE rounds ADD COLUMN extensions INTEGER NOT NULL DEFAULT 0"
                )
            if self._db.execute("SELECT COUNT(*) FROM contributions").fetchone()[0] == 0:
                self._db.execute(BACKFILL)
            self.checkpointer = Checkpointer(path, every_bytes=WAL_CHECKPOINT_BYTES)
        except sqlite3.Error as exc:
            opened = getattr(self, "_db", None)
            if opened is not None:
                with contextlib.suppress(sqlite3.Error):
                    opened.close()
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
        """BEGIN IMMEDIATE ... COMMIT; on an error, ROLLBACK if a transaction is still open
        and raise the error itself. SQLite rolls back on its own after some errors (a full
        disk among them); a ROLLBACK then fails with "no transaction is active", and
        raising that would hide the cause."""
        if self._batching:
            yield  # part of the batch's transaction
            return
        self._db.execute("BEGIN IMMEDIATE")
        # Any commit appends a few pages to the log (a row's, an index's) besides payloads.
        self._pending = 2 * PAGE_SIZE
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
            raise
        else:
            self.checkpointer.committed(self._pending)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Every write inside in one transaction (one commit, not one per update): for a
        driver that offers a thousand updates at once, the simulator's vector engine. An
        error or a crash inside loses the whole batch, never part of it."""
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
                    "method or bundle."
                )

    def run_id(self) -> str:
        """This fleet's coordinator run: drawn once, when the database is new. Signed
        updates name it, so one from an earlier database cannot be replayed into this."""
        with self._lock:
            run = self._one("SELECT value FROM meta WHERE key = 'run'")
            if run is None:
                run = secrets.token_hex(8)
                self._db.execute("INSERT INTO meta VALUES ('run', ?)", (run,))
            return str(run)

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
        with self._lock:
            stored = payload if self.keep_payloads else b""
            with self._transaction():
                cursor = self._db.execute(
                    "INSERT OR IGNORE INTO updates (round, client, received_at, payload) VALUES (?, ?, ?, ?)",
                    (round_, client, received_at, stored),
                )
                added = cursor.rowcount == 1
                if added:
                    self._wrote(len(stored))
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
        return [(client, _kept(payload, round_, client)) for client, payload in rows]

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
        return _kept(payload, round_, client)

    def arrival_times(self, round_: int) -> list[float]:
        with self._lock:
            rows = self._db.execute(
                "SELECT received_at FROM updates WHERE round = ? ORDER BY received_at", (round_,)
            ).fetchall()
        return [r[0] for r in rows]

    def advance(
        self,
        closed: int,
        *,
        closed_at: float,
        announcement: bytes,
        deadline: float,
        keep_rounds: int = 0,
        final: bool = False,
        statistics: Sequence[str] = (),
    ) -> None:
        """Close round ``closed`` and open ``closed + 1`` atomically (``final``: stored
        closed as well, in the same transaction, so a crash cannot leave the last round
        open and a restart take updates past it). With ``keep_rounds``
        > 0, the payloads (updates and announcement) of rounds older than the last
        ``keep_rounds`` closed ones are dropped in the same transaction; their timing rows
        stay. A service that runs for months would otherwise keep every update it ever
        received: 100 FedPCL devices add 1.6 MB a round, a FedAvg fleet about 95 MB.

        ``statistics``: the clients whose closed-form updates of the round carried class
        statistics: each update is copied to the statistics table in the same transaction,
        replacing that client's previous one, and outlives ``keep_rounds`` (the fleet's
        head is solved from every client's latest, :meth:`statistics_of`)."""
        with self._lock, self._transaction():
            for client in statistics:
                self._db.execute(
                    "INSERT OR REPLACE INTO statistics (client, round, payload) "
                    "SELECT client, round, payload FROM updates WHERE round = ? AND client = ?",
                    (closed, client),
                )
            self._db.execute("UPDATE rounds SET closed_at = ? WHERE round = ?", (closed_at, closed))
            self._db.execute(
                "INSERT INTO rounds (round, opened_at, deadline, closed_at, announcement) "
                "VALUES (?, ?, ?, ?, ?)",
                (closed + 1, closed_at, deadline, closed_at if final else None, announcement),
            )
            self._wrote(len(announcement))
            if keep_rounds > 0:
                oldest_kept = closed - keep_rounds + 1
                self._db.execute("DELETE FROM updates WHERE round < ?", (oldest_kept,))
                self._db.execute(
                    "UPDATE rounds SET announcement = X'' "
                    "WHERE round < ? AND length(announcement) > 0",
                    (oldest_kept,),
                )

    def statistics_clients(self) -> list[str]:
        """The clients whose statistics the statistics table holds, in client order."""
        with self._lock:
            rows = self._db.execute("SELECT client FROM statistics ORDER BY client").fetchall()
        return [client for (client,) in rows]

    def statistics_of(self, client: str) -> bytes:
        """``client``'s latest statistics-bearing update (LookupError if none)."""
        with self._lock:
            row = self._db.execute(
                "SELECT round, payload FROM statistics WHERE client = ?", (client,)
            ).fetchone()
        if row is None:
            raise LookupError(f"no statistics of {client}")
        return _kept(row[1], row[0], client)

    def record_status(
        self,
        client: str,
        *,
        state: str,
        version: str,
        last_round: int | None,
        reason: str,
        at: float,
    ) -> None:
        with self._lock, self._transaction():
            self._db.execute(
                "INSERT INTO clients VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (client) DO UPDATE SET "
                "state = excluded.state, version = excluded.version, last_round = excluded.last_round, "
                "reason = excluded.reason, updated_at = excluded.updated_at",
                (client, state, version, last_round, reason, at),
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
            db = self._db
            latest = db.execute(
                "SELECT round, opened_at, deadline, closed_at, extensions FROM rounds "
                "ORDER BY round DESC LIMIT 1"
            ).fetchone()
            completed = self._one("SELECT COUNT(*) FROM rounds WHERE closed_at IS NOT NULL")
            # Every client heard from: by its status messages, its updates, or both.
            clients = db.execute(
                "SELECT n.client, s.state, s.version, s.last_round, s.reason, s.updated_at, "
                "c.last_round, c.updates, c.last_at FROM "
                "(SELECT client FROM clients UNION SELECT client FROM contributions) AS n "
                "LEFT JOIN clients AS s ON s.client = n.client "
                "LEFT JOIN contributions AS c ON c.client = n.client ORDER BY n.client"
            ).fetchall()
            rejections = dict(
                db.execute("SELECT reason, count FROM rejections ORDER BY reason").fetchall()
            )
            in_round = (
                self._one("SELECT COUNT(*) FROM updates WHERE round = ?", (latest[0],))
                if latest
                else 0
            )
            identity = self._one("SELECT value FROM meta WHERE key = 'identity'")
            quarantined = self._one("SELECT COUNT(*) FROM quarantine")
        return {
            "identity": json.loads(identity) if identity else None,
            "round": None
            if latest is None
            else {
                "number": latest[0],
                "opened_at": latest[1],
                "deadline": latest[2],
                "closed_at": latest[3],
                "updates": in_round,
                "extensions": latest[4],
            },
            "rounds_completed": completed,
            "clients": [dict(zip(CLIENT_FIELDS, row, strict=True)) for row in clients],
            "clients_online": sum(
                1 for row in clients if row[1] == "online" and row[5] > online_since
            ),
            "rejections": rejections,
            "quarantined": quarantined,
        }


def _kept(payload: bytes, round_: int, client: str) -> bytes:
    """A stored payload, or StateError for one stored without it (``keep_payloads``): no
    update's wire form is empty, so an empty one was left out, never lost."""
    if not payload:
        raise StateError(
            f"the update of {client} in round {round_} was stored without its payload (a "
            "vector run keeps no payloads): this database cannot be resumed or served"
        )
    return bytes(payload)
