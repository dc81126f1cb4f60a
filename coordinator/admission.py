"""The checks an update passes before anything of it is stored.

Everything an update may contain is fixed by the fleet's configuration, never by another
update: the class list, the prototype dimension, the names and shapes of extra arrays,
a public per-device maximum count per class and a bound on every value. Those bounds
also make aggregation safe: with ``|count| <= max_count``, ``|value| <= max_value`` and
at most ``MAX_CLIENTS`` updates a round, every weighted sum stays below
``max_count * max_value * MAX_CLIENTS`` (1e14 with the defaults), far inside float64, and
every mean inside ``max_value``, which an announced float16 holds. No admitted update can
make an aggregate non-finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from protocol import PrototypeUpdate
from protocol.weights import AVERAGED, averaged_weight_shapes

FISHER = "fisher"


@dataclass(frozen=True)
class Admission:
    fleet: str
    bundle: str
    method: str
    num_classes: int
    dim: int
    max_count: float
    max_value: float
    allow_list: frozenset[str] = frozenset()
    #: Extra arrays by name and shape; ``None`` for FedDBP's Fisher scores, whose shape
    #: is that of the update's own prototypes.
    extras: Mapping[str, tuple[int, ...]] | None = field(
        default_factory=lambda: MappingProxyType({})
    )

    @classmethod
    def for_fleet(
        cls,
        *,
        fleet: str,
        bundle: str,
        method: str,
        classes: int,
        dim: int,
        max_count: float,
        max_value: float,
        feature_dim: int = 0,
        norm: str = "batch",
        allow_list: tuple[str, ...] = (),
    ) -> Admission:
        extras: Mapping[str, tuple[int, ...]] | None = MappingProxyType({})
        if method in AVERAGED:
            extras = MappingProxyType(
                averaged_weight_shapes(
                    feature_dim=feature_dim,
                    out_dim=dim,
                    num_classes=classes,
                    norm=norm,  # type: ignore[arg-type]
                )
            )
        elif method == "feddbp":
            extras = None
        return cls(
            fleet=fleet,
            bundle=bundle,
            method=method,
            num_classes=classes,
            dim=dim,
            max_count=max_count,
            max_value=max_value,
            allow_list=frozenset(allow_list),
            extras=extras,
        )

    def check(self, update: PrototypeUpdate, *, topic_client: str | None = None) -> str | None:
        """Why ``update`` may not be stored, or None if it may."""
        if topic_client is not None and update.client != topic_client:
            return "client_mismatch"
        if update.fleet != self.fleet:
            return "wrong_fleet"
        if update.bundle != self.bundle:
            return "wrong_bundle"
        if update.method != self.method:
            return "wrong_method"
        if self.allow_list and update.client not in self.allow_list:
            return "not_allowed"
        if any(c >= self.num_classes for c in update.classes):
            return "unknown_class"
        if update.prototypes.shape[1] != self.dim:
            return "wrong_dim"
        if any(c > self.max_count for c in update.counts):
            return "count_above_max"
        if self._extras_mismatch(update):
            return "wrong_extras"
        arrays = (update.prototypes, *update.extras.values())
        if any(a.size and float(np.abs(a).max()) > self.max_value for a in arrays):
            return "value_above_max"
        return None

    def _extras_mismatch(self, update: PrototypeUpdate) -> bool:
        got = {name: a.shape for name, a in update.extras.items()}
        if self.extras is None:
            return got != {FISHER: update.prototypes.shape}
        return got != dict(self.extras)
