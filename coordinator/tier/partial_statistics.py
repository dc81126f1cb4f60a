"""Closed-form statistics split over workers: a worker's sum of the statistics its stored
updates carry, the merge of such sums, and the fleet's total with a round's replacements.

The statistics LDA and ridge are solved from (per-class counts and sums, the second
moment) and FedCOF's (counts, sums, the per-class scatter of the devices' means, the
holders) are sums over devices (closed_form/statistics.py::merge). So a round's
statistics split over workers as the prototype methods' sums do (coordinator/tier/partial.py):
each worker sums the statistics of the updates it stored (:func:`part_of`), the owner adds
the workers' sums (:func:`merge_parts`), and the result is the single coordinator's sum
whatever the split, up to float64 rounding: another grouping rounds at other points, which
moves a sum by about 1e-16 relative, as for :func:`coordinator.tier.partial.merge`. Every sum
here is taken with the single coordinator's own accumulator
(closed_form/statistics.py::StatisticsSum), on statistics decoded by its own
``statistics_of``.

Which statistics a client's later ones replace, across workers, is the owner's
(coordinator/tier/owner_statistics.py); :func:`replaced` is its arithmetic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import closed_form as cf
from coordinator.strategies.closed_form import statistics_of
from coordinator.tier.partial import OverlapError
from protocol import PrototypeUpdate


# eq=False: it holds arrays (cf.Statistics compares by identity for the same reason).
@dataclass(frozen=True, eq=False)
class StatisticsPart:
    """The statistics of ``clients`` summed, one device each (``stats.devices``)."""

    stats: cf.Statistics
    clients: frozenset[str]

    def __post_init__(self) -> None:
        if self.stats.devices != len(self.clients):
            raise ValueError(
                f"statistics of {self.stats.devices} device(s) for {len(self.clients)} client(s)"
            )
        if (self.stats.gram is None) == (self.stats.scatter is None):
            raise ValueError("a statistics part carries a second moment or a scatter, not both")

    @property
    def gram(self) -> bool:
        """LDA's and ridge's kind (a second moment); FedCOF's carries a scatter instead."""
        return self.stats.gram is not None

    @classmethod
    def empty(cls, *, num_classes: int, dim: int, gram: bool) -> StatisticsPart:
        stats = cf.Statistics.empty(num_classes=num_classes, dim=dim, gram=gram, scatter=not gram)
        return cls(stats=stats, clients=frozenset())


def part_of(
    updates: Iterable[PrototypeUpdate], *, num_classes: int, dim: int, gram: bool
) -> StatisticsPart:
    """The summed statistics of the updates that carry some (rows); an update with no rows
    (its statistics were sent before) adds nothing. Refuses two from one client: a worker
    stores one update per (round, client)."""
    total = cf.StatisticsSum(num_classes=num_classes, dim=dim, gram=gram, scatter=not gram)
    clients: list[str] = []
    for update in updates:
        if update.classes:
            total.add(statistics_of(update, num_classes=num_classes, dim=dim))
            clients.append(update.client)
    if len(set(clients)) != len(clients):
        raise OverlapError(_repeated(clients))
    stats = total.statistics()
    if stats is None:
        return StatisticsPart.empty(num_classes=num_classes, dim=dim, gram=gram)
    return StatisticsPart(stats=stats, clients=frozenset(clients))


def merge_parts(parts: Iterable[StatisticsPart]) -> StatisticsPart:
    """The statistics of the union of the parts' clients. Refuses parts that share a
    client (counted twice), of other shapes or kinds (runtime's merge), and none at all."""
    items = list(parts)
    if not items:
        raise ValueError("merge_parts needs at least one part")
    clients = frozenset().union(*(p.clients for p in items))
    if len(clients) != sum(len(p.clients) for p in items):
        raise OverlapError(_repeated(c for p in items for c in p.clients))
    return StatisticsPart(stats=cf.merge(p.stats for p in items), clients=clients)


def _repeated(clients: Iterable[str]) -> set[str]:
    return {client for client, n in Counter(clients).items() if n > 1}


def replaced(total: cf.Statistics, new: cf.Statistics, old: cf.Statistics) -> cf.Statistics:
    """``total + new - old``: the fleet's statistics once a round's ``new`` ones are added
    and the earlier ones of the clients they replace (``old``) taken out, in the single
    coordinator's order (coordinator/rounds/statistics.py::FleetStatistics.solve). The empty
    statistics when no device is left."""
    out = cf.StatisticsSum.of(total)
    out.add(new)
    out.add(old, sign=-1)
    stats = out.statistics()
    if stats is not None:
        return stats
    gram = total.gram is not None
    return cf.Statistics.empty(
        num_classes=total.num_classes, dim=total.dim, gram=gram, scatter=not gram
    )
