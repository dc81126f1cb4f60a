"""The closed-form methods' state at the coordinator: the sum of every client's latest
class statistics, the open round's new ones, and the head they solve.

A device sends its statistics once per data version; a later set from the same client
replaces its earlier one. The coordinator keeps sums, not every client's statistics (ten
thousand second moments of 512 features are 10 GB): the fleet's total, and the total of
the statistics that arrived in the open round, each a running sum
(closed_form/statistics.py::StatisticsSum) added to in place as an update is accepted.
At the close the round's are added to the fleet's, less the earlier statistics of the
clients they replace (read back from the store's statistics table), the head is solved,
and the new total takes effect once the store has committed the close; the table then
holds each client's latest, from which a restart (or a reload) rebuilds the total, from
the clients that pass today's checks, enrolment included (a client unenrolled, revoked or
forgotten is left out, said in the log).

The head is solved from the total with each client's weight per class capped
(``[closed_form] count_cap``, closed_form/robust.py): the total itself stays every client's
statistics as sent, and the capped clients' corrections are made afresh at each solve,
since the medians move as clients join. Each client's counts (C values) are kept in memory
to find them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

import closed_form as cf
from coordinator.storage.store import Store
from coordinator.strategies.base import Aggregate
from coordinator.strategies.closed_form import ClosedForm, statistics_of
from protocol import ProtocolError, PrototypeUpdate

log = logging.getLogger(__name__)


class FleetStatistics:
    """Every client's latest statistics, summed, for one closed-form fleet."""

    def __init__(
        self,
        *,
        store: Store,
        strategy: ClosedForm,
        num_classes: int,
        dim: int,
        gram: bool,
        admissible: Callable[[PrototypeUpdate], str | None],
        count_cap: float = 0.0,
    ) -> None:
        """``admissible``: why a stored update would not be admitted today, or None (a
        statistics row kept under another configuration, or of a client no longer
        enrolled, is left out, not summed). ``count_cap``: a client's weight in a class
        is at most this multiple of the class's median holder's (closed_form/robust.py;
        0: uncapped)."""
        self.store, self.strategy = store, strategy
        self.num_classes, self.dim, self.gram = num_classes, dim, gram
        self.count_cap = count_cap
        self.total = self._empty()
        #: Every held client's counts (C,): what the per-class caps are taken over.
        self.counts: dict[str, np.ndarray] = {}
        for client in store.statistics_clients():
            update = self._readable(client, admissible)
            if update is not None:
                part = self._part(update)
                self.total.add(part)
                self.counts[client] = np.array(part.counts)
        self.round_sum = self._empty()
        self.round_clients: list[str] = []
        self.round_counts: dict[str, np.ndarray] = {}
        self.solved: Aggregate | None = None
        self._next: tuple[cf.StatisticsSum, dict[str, np.ndarray]] | None = None

    @property
    def held(self) -> set[str]:
        """The clients whose statistics are in the fleet's sum."""
        return set(self.counts)

    def _empty(self) -> cf.StatisticsSum:
        return cf.StatisticsSum(
            num_classes=self.num_classes, dim=self.dim, gram=self.gram, scatter=not self.gram
        )

    def _part(self, update: PrototypeUpdate) -> cf.Statistics:
        return statistics_of(update, num_classes=self.num_classes, dim=self.dim)

    def _readable(
        self, client: str, admissible: Callable[[PrototypeUpdate], str | None]
    ) -> PrototypeUpdate | None:
        try:
            update = PrototypeUpdate.from_wire(self.store.statistics_of(client), max_bytes=1 << 62)
        except (ProtocolError, ValueError) as exc:
            log.warning("the stored statistics of %s are left out: %s", client, exc)
            return None
        why = admissible(update)
        if why is not None:
            # Kept under another configuration (dim, classes, bundle, method): the fleet's
            # head goes on without them rather than the service failing every restart.
            log.warning("the stored statistics of %s are left out: %s", client, why)
            return None
        return update

    def take(self, update: PrototypeUpdate) -> None:
        """An accepted update of the open round that carries statistics."""
        part = self._part(update)
        self.round_sum.add(part)
        self.round_clients.append(update.client)
        self.round_counts[update.client] = np.array(part.counts)

    def solve(self, round_: int) -> Aggregate:
        """The head of every client's latest statistics, each client's weight capped
        (:meth:`bounded`): round ``round_``'s replace their clients' earlier ones (the
        same head again when none came). Takes effect with :meth:`committed`, once the
        store has the close."""
        if not self.round_clients and self.solved is not None:
            self._next = None
            return self.solved
        total = self.total.plus(self.round_sum)
        for client in self.round_clients:
            if client in self.counts:
                total.add(self._part(self._stored(client)), sign=-1)
        counts = {**self.counts, **self.round_counts}
        bounded = self.bounded(total, counts, round_)
        stats = bounded.statistics()
        self.solved = Aggregate() if stats is None else self.strategy.solve_statistics(stats)
        self._next = (total, counts)
        return self.solved

    def bounded(
        self, total: cf.StatisticsSum, counts: dict[str, np.ndarray], round_: int
    ) -> cf.StatisticsSum:
        """``total`` with each client above a class's cap counted at the cap: those
        clients' statistics are read back (from the round's updates or the store), one at
        a time, so memory stays one client's; the counts, kept for every client, say
        which."""
        if self.count_cap <= 0 or not counts:
            return total
        caps = cf.count_caps(np.stack(list(counts.values())), self.count_cap)
        out: cf.StatisticsSum | None = None
        for client, n in sorted(counts.items()):
            if not (n > caps).any():
                continue
            stored = (self.store.update_payload(round_, client) if client in self.round_counts
                      else self.store.statistics_of(client))  # fmt: skip
            part = self._part(PrototypeUpdate.from_wire(stored, max_bytes=1 << 62))
            out = out or total.plus(self._empty())
            out.add(part, sign=-1)
            out.add(cf.capped(part, caps))
            log.info("the statistics of %s are capped at %s times the median holder's count",
                     client, self.count_cap, extra={"event": "statistics_capped", "client": client})  # fmt: skip
        return total if out is None else out

    def held_classes(self) -> frozenset[int]:
        """The classes some client's statistics hold (a count of at least one), after
        :meth:`solve`: the round's clients' replacing their earlier ones."""
        counts = self._next[1] if self._next is not None else self.counts
        if not counts:
            return frozenset()
        most = np.stack(list(counts.values())).max(axis=0)
        return frozenset(int(c) for c in np.flatnonzero(most >= 1.0))

    def _stored(self, client: str) -> PrototypeUpdate:
        return PrototypeUpdate.from_wire(self.store.statistics_of(client), max_bytes=1 << 62)

    def committed(self) -> None:
        """The close is stored: the new total is the fleet's, and a new round begins."""
        if self._next is not None:
            self.total, self.counts = self._next
        self._next = None
        self.round_sum = self._empty()
        self.round_clients = []
        self.round_counts = {}
