"""FPL: FINCH cluster prototypes per class and their mean, the unbiased prototype, on top
of FedAvg.

The announcement's global prototypes are the unbiased prototypes (FPL Eq. 6); the cluster
prototypes travel as extras ``clusters`` (M, d) with ``cluster_classes`` (M,) giving each
row's class index, which the client's CPCL term contrasts against. FPL is built on FedAvg
(its Algorithm 1, server side: the new global model is the data-size-weighted mean of the
clients' models, and the method is evaluated by that global model), so the clients' head
and classifier weights are averaged as FedAvg's are and announced beside the clusters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordinator import aggregate as agg
from coordinator.strategies.base import Aggregate, Strategy, globals_of, register
from protocol import PrototypeUpdate


@register("fpl")
class FPL(Strategy):
    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        d = self.dense(updates, num_classes=num_classes, dim=dim)
        mask = agg.present_mask(d.counts)
        unbiased = np.zeros((num_classes, dim), dtype=np.float64)
        clusters: list[np.ndarray] = []
        owners: list[np.ndarray] = []
        for c in np.flatnonzero(mask.any(axis=0)):
            points = d.protos[mask[:, c], c]
            centres = agg.cluster_means(points, agg.finch_first_partition(points))
            # Eq. 6: the (robust) mean of the cluster prototypes, each cluster counted once.
            unbiased[c] = self.combine(centres[:, None], np.ones((len(centres), 1)))[0][0]
            clusters.append(centres)
            owners.append(np.full(centres.shape[0], c, dtype=np.float32))
        classes, rows = globals_of(unbiased, np.asarray(mask.any(axis=0)))
        extras = self.average_weights(updates, num_classes=num_classes)
        if clusters:
            extras["clusters"] = np.concatenate(clusters).astype(np.float32)
            extras["cluster_classes"] = np.concatenate(owners)
        return Aggregate(global_classes=classes, global_prototypes=rows, extras=extras)
