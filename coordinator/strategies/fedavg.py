"""FedAvg baseline: the sample-count-weighted mean of every weight array the clients send
as extras (the head and the linear classifier). No prototypes are aggregated."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordinator.strategies.base import Aggregate, Strategy, register
from protocol import PrototypeUpdate


@register("fedavg")
class FedAvg(Strategy):
    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        if not updates:
            return Aggregate()
        shapes = {n: a.shape for n, a in updates[0].extras.items()}
        # Only clients that sent every array with the same shapes can be averaged together.
        usable = [u for u in updates if {n: a.shape for n, a in u.extras.items()} == shapes]
        weights = np.array([float(sum(u.counts)) for u in usable])
        if self.robust.count_cap is not None:
            weights = np.minimum(weights, self.robust.count_cap * num_classes)
        if not shapes or weights.sum() <= 0:
            return Aggregate()
        averaged = {}
        for name in sorted(shapes):
            stack = np.stack([u.extras[name].astype(np.float64) for u in usable])
            if self.robust.rule == "median":
                averaged[name] = np.median(stack, axis=0)
            else:
                averaged[name] = np.tensordot(weights / weights.sum(), stack, axes=1)
        return Aggregate(extras=averaged)
