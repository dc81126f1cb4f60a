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
holds each client's latest, from which a restart rebuilds the total.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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
    ) -> None:
        """``admissible``: why a stored update would not be admitted today, or None (a
        statistics row kept under another configuration is left out, not summed)."""
        self.store, self.strategy = store, strategy
        self.num_classes, self.dim, self.gram = num_classes, dim, gram
        self.total = self._empty()
        self.held: set[str] = set()
        for client in store.statistics_clients():
            update = self._readable(client, admissible)
            if update is not None:
                self.total.add(self._part(update))
                self.held.add(client)
        self.round_sum = self._empty()
        self.round_clients: list[str] = []
        self.solved: Aggregate | None = None
        self._next: tuple[cf.StatisticsSum, set[str]] | None = None

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
        self.round_sum.add(self._part(update))
        self.round_clients.append(update.client)

    def solve(self) -> Aggregate:
        """The head of every client's latest statistics: the round's replace their
        clients' earlier ones (the same head again when none came). Takes effect with
        :meth:`committed`, once the store has the close."""
        if not self.round_clients and self.solved is not None:
            self._next = None
            return self.solved
        total = self.total.plus(self.round_sum)
        held = set(self.held)
        for client in self.round_clients:
            if client in held:
                old = PrototypeUpdate.from_wire(self.store.statistics_of(client), max_bytes=1 << 62)
                total.add(self._part(old), sign=-1)
            held.add(client)
        stats = total.statistics()
        self.solved = Aggregate() if stats is None else self.strategy.solve_statistics(stats)
        self._next = (total, held)
        return self.solved

    def committed(self) -> None:
        """The close is stored: the new total is the fleet's, and a new round begins."""
        if self._next is not None:
            self.total, self.held = self._next
        self._next = None
        self.round_sum = self._empty()
        self.round_clients = []
