"""The round owner's closed-form state (coordinator/tier/owner.py): the fleet's statistics
total, where the statistics it counts for each client are stored, and a round's close, in
which a client's later statistics replace its earlier ones.

**The choice.** Only sums travel. The owner keeps, in the coordinator's database, the
fleet's total (every client's latest statistics, summed) and for each client only which
worker stored the copy it counts and in which round: ids, no arrays. When a round's
partials bring new statistics from a client the total already holds, the owner asks the
worker that stored the earlier copy for its statistics back (the collect's second phase,
``CollectRequest.retract``, beside the exclusions; the worker reads the copy from its
database, coordinator/tier/intake.py) and closes with ``total + new - old``, the single
coordinator's arithmetic (coordinator/rounds/statistics.py), where it reads the earlier copy
from its statistics table. Two alternatives were set aside:

- the owner keeping every client's latest statistics, as the single coordinator's
  statistics table does: each client's would travel to the owner once per data version,
  and those updates are nearly all a closed-form fleet uploads (a 512-d second moment is
  1 MB a client), which is what the worker tier takes off one process;
- the workers sending per-client statistics of the replaced clients: the worker that
  takes a client's new statistics holds its earlier ones only when the broker gave both
  to it (Mosquitto's round robin mostly does not), and the subtraction needs the earlier.

**Exactly once.** A round's statistics are counted from the copy the exclusions keep
(coordinator/tier/partial_wire.py::exclusions: a resend stored by a second worker counts
once), the directory records that copy's worker and round, and a retraction takes back
that copy: the one counted.

**Durable.** A close writes the new total and directory rows, labelled with the closing
round, before ``Store.advance`` commits the close. At start, rows labelled at or after
the open round are a close that did not commit: dropped (the round is collected again,
and the same rows written). So the state read is always the last committed close's.

**What it cannot do**: take back statistics whose copy is gone (its worker taken out of
``[workers] names``, or its database lost). The total then keeps the earlier statistics
and the client's new ones are left out (excluded from their worker's partial), logged.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import closed_form as cf
from coordinator.storage.schema import immediate
from coordinator.strategies.base import Aggregate
from coordinator.strategies.closed_form import ClosedForm
from coordinator.tier.partial_fields import statistics_from
from coordinator.tier.partial_statistics import StatisticsPart, merge_parts, replaced
from coordinator.tier.partial_wire import PartialMessage
from protocol import ProtocolError
from protocol.codec import pack, unpack

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS owner_statistics (round INTEGER PRIMARY KEY, total BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS owner_statistics_holders (
    client TEXT NOT NULL,
    round INTEGER NOT NULL,
    worker TEXT NOT NULL,
    PRIMARY KEY (client, round)
);
"""
_VERSION = 1


@dataclass(frozen=True)
class Holding:
    """Where the statistics the total counts for a client are: a worker's copy of
    ``round``."""

    worker: str
    round: int


@dataclass(frozen=True, eq=False)
class Close:
    """A round's close of the statistics, before it is committed: the new total, the
    clients whose statistics it now counts from this round, and the head it solves."""

    round: int
    total: cf.Statistics
    fresh: Mapping[str, Holding] = field(default_factory=dict)
    result: Aggregate = field(default_factory=Aggregate)

    @property
    def changed(self) -> bool:
        return bool(self.fresh)


class OwnerStatistics:
    """The owner's closed-form state, on a connection of its own to the coordinator's
    database (coordinator/storage/store.py's is not shared). Not thread-safe: the owner calls
    it under its lock."""

    def __init__(
        self,
        *,
        path: Path,
        strategy: ClosedForm,
        num_classes: int,
        dim: int,
        gram: bool,
        open_round: int,
        synchronous: str = "NORMAL",
    ) -> None:
        self.strategy = strategy
        self.num_classes, self.dim, self.gram = num_classes, dim, gram
        self.path = path
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        try:
            self.total, self.held = self._load(synchronous, open_round)
        except BaseException:
            self._db.close()
            raise
        #: The head of ``total`` (every client's latest statistics, summed) once solved:
        #: announced again while nothing changes it. ``held``: where each client's are.
        self.solved: Aggregate | None = None

    def _load(self, synchronous: str, open_round: int) -> tuple[cf.Statistics, dict[str, Holding]]:
        """The last committed close's total, and each client's holding."""
        db = self._db
        db.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'FULL' else 'NORMAL'}")
        db.executescript(SCHEMA)
        with immediate(db):
            # A close written but not committed by Store.advance: the round is open again.
            for table in ("owner_statistics", "owner_statistics_holders"):
                db.execute(f"DELETE FROM {table} WHERE round >= ?", (open_round,))
        row = db.execute(
            "SELECT total FROM owner_statistics ORDER BY round DESC LIMIT 1"
        ).fetchone()
        total = self._empty() if row is None else self._decoded(bytes(row[0]))
        held = {
            client: Holding(worker=worker, round=round_)
            for client, worker, round_ in db.execute(
                # SQLite takes the bare column (worker) from the row holding the MAX.
                "SELECT client, worker, MAX(round) FROM owner_statistics_holders GROUP BY client"
            )
        }
        return total, held

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _empty(self) -> cf.Statistics:
        return StatisticsPart.empty(
            num_classes=self.num_classes, dim=self.dim, gram=self.gram
        ).stats

    def _decoded(self, payload: bytes) -> cf.Statistics:
        try:
            obj = unpack(payload, max_bytes=len(payload))
            if obj.pop("v", None) != _VERSION:
                raise ProtocolError(f"not a version {_VERSION} statistics total")
            return statistics_from(obj, num_classes=self.num_classes, dim=self.dim)
        except ProtocolError as exc:
            # Without it the heads would be solved from a part of the fleet: say so.
            raise ValueError(
                f"the closed-form statistics total in {self.path} is unreadable ({exc}); "
                "model.classes or model.dim changed since it was written?"
            ) from exc

    # -- the collect -----------------------------------------------------------------------

    def replacing(
        self,
        kept: Mapping[str, frozenset[str]],
        *,
        members: Collection[str],
        answered: Mapping[str, PartialMessage],
    ) -> tuple[dict[str, dict[str, int]], dict[str, set[str]]]:
        """What the collect must ask for: for each worker, the earlier copies to take back
        (client -> round), and the clients whose new statistics to leave out because the
        earlier cannot be taken back (their worker is not a member, or ``answered`` says
        it no longer holds the copy).

        ``kept``: each worker's clients whose new statistics the round counts (its first
        partial's, less the exclusions). ``answered``: the answers to the asks so far.
        """
        retract: dict[str, dict[str, int]] = {}
        lost: dict[str, set[str]] = {}
        newer = {client: worker for worker, clients in kept.items() for client in clients}
        for client, worker in sorted(newer.items()):
            before = self.held.get(client)
            if before is None:
                continue
            if before.worker in members:
                retract.setdefault(before.worker, {})[client] = before.round
            else:
                lost.setdefault(worker, set()).add(client)
                log.warning(
                    "%s: its statistics of round %d are on worker %s, not in [workers] names; "
                    "they stay counted and its new ones are left out", client, before.round,
                    before.worker,
                )  # fmt: skip
        for holder, asked in retract.items():
            answer = answered.get(holder)
            if answer is None or dict(answer.retract) != asked or answer.retraction is None:
                continue
            for client in sorted(set(asked) - answer.retraction.clients):
                lost.setdefault(newer[client], set()).add(client)
                log.error(
                    "%s: worker %s no longer holds its statistics of round %d (a lost "
                    "database?); they stay counted and its new ones are left out",
                    client, holder, asked[client],
                )  # fmt: skip
        return retract, lost

    # -- the close -------------------------------------------------------------------------

    def solve(self, answers: Mapping[str, PartialMessage], *, round_: int) -> Close:
        """The statistics of ``round_``'s final ``answers`` (one per worker, their clients
        disjoint) added, the earlier ones they replace taken out, and the head solved; the
        same head again when the round brought none (as coordinator/rounds/statistics.py does)."""
        empty = StatisticsPart(stats=self._empty(), clients=frozenset())
        new = merge_parts([empty, *(m.statistics for m in answers.values() if m.statistics)])
        old = merge_parts([empty, *(m.retraction for m in answers.values() if m.retraction)])
        if not old.clients <= new.clients & set(self.held):
            # The collect asks only for the earlier copies of clients counted anew.
            raise ValueError(f"statistics taken back but not replaced: {old.clients - new.clients}")
        if not new.clients and self.solved is not None:
            return Close(round=round_, total=self.total, result=self.solved)
        total = replaced(self.total, new.stats, old.stats)
        result = Aggregate() if total.devices == 0 else self.strategy.solve_statistics(total)
        fresh = {
            client: Holding(worker=worker, round=round_)
            for worker, m in answers.items()
            if m.statistics is not None
            for client in m.statistics.clients
        }
        return Close(round=round_, total=total, fresh=fresh, result=result)

    def save(self, close: Close) -> None:
        """Write ``close`` labelled with its round, before the store commits the round's
        close; older rows the committed closes replaced are dropped."""
        if not close.changed:
            return
        total = pack({"v": _VERSION, **cf.statistics_fields(close.total)})
        with self._lock, immediate(self._db):
            db, r = self._db, close.round
            db.execute("INSERT OR REPLACE INTO owner_statistics VALUES (?, ?)", (r, total))
            db.executemany(
                "INSERT OR REPLACE INTO owner_statistics_holders VALUES (?, ?, ?)",
                [(client, r, h.worker) for client, h in sorted(close.fresh.items())],
            )
            # Kept: this close's rows and the last committed ones (a restart before the
            # store commits this close goes back to them).
            db.execute(
                "DELETE FROM owner_statistics WHERE round < "
                "(SELECT MAX(round) FROM owner_statistics WHERE round < ?)",
                (r,),
            )
            db.execute(
                "DELETE FROM owner_statistics_holders WHERE EXISTS (SELECT 1 FROM "
                "owner_statistics_holders AS later WHERE later.client = "
                "owner_statistics_holders.client AND later.round > "
                "owner_statistics_holders.round AND later.round < ?)",
                (r,),
            )

    def committed(self, close: Close) -> None:
        """The store has committed the round's close: ``close`` is the owner's state."""
        self.total = close.total
        self.held.update(close.fresh)
        self.solved = close.result
