"""FedDBP: client-wise mean global prototypes, personalised per client by Top-K Fisher
channel fusion (Eq. 9-10). Each update carries ``extras["fisher"]`` of the same shape as
its prototypes (per-class channel importance, Eq. 8)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordinator import aggregate as agg
from coordinator.strategies.base import Aggregate, RobustOptions, Strategy, globals_of, register
from protocol import PrototypeUpdate

FISHER = "fisher"


@register("feddbp")
class FedDBP(Strategy):
    """``top_k`` channels (paper: 30) fused with weight ``eta`` (paper: 1.0)."""

    def __init__(
        self, *, top_k: int = 30, eta: float = 1.0, robust: RobustOptions | None = None
    ) -> None:
        super().__init__(robust=robust)
        if top_k < 0:
            raise ValueError(f"top_k must be non-negative, got {top_k}")
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {eta}")
        self.top_k = top_k
        self.eta = eta

    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        d = self.dense(updates, num_classes=num_classes, dim=dim)
        # The client-wise mean of FedDBP's Sec. 3.2 is FedProto's aggregation.
        values, has = self.combine(d.protos, d.counts)
        classes, rows = globals_of(values, has)
        mask = agg.present_mask(d.counts)
        personal = {}
        for u, (client, update) in enumerate(zip(d.clients, updates, strict=True)):
            scores = np.zeros((num_classes, dim), dtype=np.float64)
            fisher = update.extras.get(FISHER)
            if fisher is not None and fisher.shape == update.prototypes.shape:
                scores[list(update.classes)] = fisher
            # A class the client lacks keeps the global row: fusing it with itself is a no-op.
            local = np.where(mask[u][:, None], d.protos[u], values)
            fused = agg.topk_fusion(local, values, scores, k=self.top_k, eta=self.eta)
            personal[client] = fused[has]
        return Aggregate(global_classes=classes, global_prototypes=rows, client_globals=personal)
