"""FedAvg baseline: the sample-count-weighted mean of every weight array the clients send
as extras (the head and the linear classifier). No prototypes are aggregated."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.strategies.base import Aggregate, Strategy, register
from protocol import PrototypeUpdate


@register("fedavg")
class FedAvg(Strategy):
    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        return Aggregate(extras=self.average_weights(updates, num_classes=num_classes))
