"""FedProto: the server averages the local prototypes of the clients holding each class."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.strategies.base import Aggregate, PartialMean, Strategy, globals_of, register
from protocol import PrototypeUpdate


@register("fedproto")
class FedProto(Strategy):
    @property
    def partial_mean(self) -> PartialMean:
        return "client"  # the holders' plain mean

    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        d = self.dense(updates, num_classes=num_classes, dim=dim)
        values, has = self.combine(d.protos, d.counts)
        classes, rows = globals_of(values, has)
        return Aggregate(global_classes=classes, global_prototypes=rows)
