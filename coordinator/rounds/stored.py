"""The single coordinator's two tallies over the updates it stores
(coordinator/rounds/tally.py): the method's strategy over the round's stored updates, and,
for the closed-form methods, the running sum of every client's latest statistics
(coordinator/rounds/statistics.py), added to as updates arrive."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.rounds.head_guard import guarded
from coordinator.rounds.open_round import OpenRound
from coordinator.rounds.statistics import FleetStatistics
from coordinator.rounds.tally import Tallied, Tally
from coordinator.storage.store import Store
from coordinator.strategies import Aggregate, Strategy
from protocol import PrototypeUpdate, RoundAnnouncement


class StoredUpdates(Tally):
    """The strategy over the round's stored updates, read back at the close by ``read``."""

    def __init__(
        self,
        *,
        store: Store,
        strategy: Strategy,
        num_classes: int,
        dim: int,
        read: Callable[[str], PrototypeUpdate],
    ) -> None:
        self.store, self.strategy, self.read = store, strategy, read
        self.num_classes, self.dim = num_classes, dim

    def tally(self, closing: OpenRound, *, now: float, last: RoundAnnouncement) -> Tallied:
        clients = self.store.update_clients(closing.number)
        updates = [self.read(c) for c in clients]
        result = self.strategy.aggregate(updates, num_classes=self.num_classes, dim=self.dim)
        return Tallied(result, updates=len(clients), source=",".join(clients))


class RunningStatistics(Tally):
    """Every client's latest closed-form statistics, summed as they arrive: a round of
    10,000 clients' statistics is not held update by update."""

    takes_updates = True

    def __init__(self, *, store: Store, statistics: FleetStatistics) -> None:
        self.store, self.statistics = store, statistics

    def take(self, update: PrototypeUpdate) -> None:
        if update.classes:
            self.statistics.take(update)

    def tally(self, closing: OpenRound, *, now: float, last: RoundAnnouncement) -> Tallied:
        clients = self.store.update_clients(closing.number)
        solved = self.statistics.solve(closing.number)
        result, kept = guarded(solved, last, held=self.statistics.held_classes())
        return Tallied(
            result, updates=len(clients), source=",".join(clients),
            statistics=tuple(self.statistics.round_clients), kept=kept,
        )  # fmt: skip

    def skipped(self) -> Sequence[str]:
        return list(self.statistics.round_clients)

    def committed(self, tallied: Tallied | None) -> None:
        self.statistics.committed()

    @property
    def solved(self) -> Aggregate | None:
        """The float64 head last solved, before the announcement's cast."""
        return self.statistics.solved
