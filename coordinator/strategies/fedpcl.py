"""FedPCL: weighted global prototypes (Eq. 6) and padded local sets (Eq. 7).

Under ``robust.median_direction_screen`` (default) a row screened out by
:func:`coordinator.aggregate.screen_directions` counts for nothing in the global prototype
and is relayed as its class's global row, exactly as a class the client did not report
(Eq. 7's padding): the honest devices contrast against neither copy of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator import aggregate as agg
from coordinator.strategies.base import (
    Aggregate,
    PartialMean,
    RobustOptions,
    Strategy,
    globals_of,
    register,
)
from protocol import PrototypeUpdate


@register("fedpcl")
class FedPCL(Strategy):
    """``weighting="count"`` (default) is the count-weighted mean; ``"paper"`` adds the
    printed ``1/|N_j|`` factor. The default keeps global prototypes on the scale of the
    unit-norm features they are contrasted with, whatever the number of clients; with
    the paper's form the logits of Eq. 8 shrink as the fleet grows."""

    def __init__(
        self, *, weighting: agg.Weighting = "count", robust: RobustOptions | None = None
    ) -> None:
        super().__init__(robust=robust)
        if weighting not in ("count", "paper"):
            raise ValueError(f"weighting must be 'count' or 'paper', got {weighting!r}")
        self.weighting: agg.Weighting = weighting

    @property
    def partial_mean(self) -> PartialMean:
        return self.weighting

    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        d = self.dense(updates, num_classes=num_classes, dim=dim)
        counts = d.counts
        if self.robust.median_direction_screen:
            counts, _ = agg.screen_directions(d.protos, counts)
        if self.robust.rule == "mean":
            values, has = agg.count_weighted_mean(d.protos, counts, weighting=self.weighting)
        else:
            values, has = self.combine(d.protos, counts)
        classes, rows = globals_of(values, has)
        padded = agg.pad_local_sets(d.protos, counts, values, has)
        return Aggregate(
            global_classes=classes,
            global_prototypes=rows,
            local_sets={client: padded[u] for u, client in enumerate(d.clients)},
        )
