"""Solo baseline: no federation. Rounds still run so every method shares one driver."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.strategies.base import Aggregate, Strategy, register
from protocol import PrototypeUpdate


@register("solo")
class Solo(Strategy):
    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        return Aggregate()
