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

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from closed_form import triangle_size
from closed_form.arrays import F64
from closed_form.projection import basis_problem
from coordinator.aggregate import NORM_TOLERANCE
from coordinator.statistics_checks import StatisticsBounds, statistics_problem
from protocol import PrototypeUpdate
from protocol.methods import BASIS, COUNTS, GRAM, wire_method
from protocol.weights import averaged_weight_shapes

FISHER = "fisher"

log = logging.getLogger(__name__)


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
    #: Closed-form methods (protocol/methods.py): their prototype rows are class sums
    #: (and their second moment, sums over all samples), bounded by the counts rather than
    #: by ``max_value``; an update with no rows (statistics sent before) carries no extras.
    statistics: bool = False
    #: The method's prototype rows are means of unit-norm embeddings (every trained-head
    #: method: protocol/methods.py), so without noise no honest row is longer than 1.
    unit_means: bool = False
    #: Closed-form methods: the bundle's feature size ``D`` a release's basis check must
    #: name (``model.feature_dim``; 0: any, each checked against its own projection).
    features: int = 0
    #: Closed-form methods: what the fleet's configuration says a device's release is
    #: (``[closed_form]``): exact or noisy, and the public per-device sample bound. The
    #: update's own privacy field never decides how it is checked.
    release: StatisticsBounds = field(
        default_factory=lambda: StatisticsBounds(max_samples=100_000.0)
    )
    #: Closed-form methods: the fleet's public basis (None for the random projection),
    #: what a release's basis check is held to; read once, with the state's identity, so a
    #: file written again mid-run cannot move the check away from the sum it guards.
    basis: F64 | None = field(default=None, compare=False)

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
        release: StatisticsBounds | None = None,
        basis: F64 | None = None,
    ) -> Admission:
        extras: Mapping[str, tuple[int, ...]] | None = MappingProxyType({})
        kind = wire_method(method).extras
        if kind == "weights":
            extras = MappingProxyType(
                averaged_weight_shapes(
                    feature_dim=feature_dim,
                    out_dim=dim,
                    num_classes=classes,
                    norm=norm,  # type: ignore[arg-type]
                )
            )
        elif kind == "fisher":
            extras = None
        elif kind == "statistics" and wire_method(method).gram:
            extras = MappingProxyType({GRAM: (triangle_size(dim),)})
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
            statistics=kind == "statistics",
            unit_means=not wire_method(method).closed_form,
            features=feature_dim if kind == "statistics" else 0,
            release=release or StatisticsBounds(max_samples=100_000.0),
            basis=basis,
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
        if self.statistics and update.classes and self.wrong_basis(update):
            return "wrong_basis"
        if self._extras_mismatch(update):
            return "wrong_extras"
        if self.statistics:
            return self.statistics_problem(update)
        arrays = (update.prototypes, *update.extras.values())
        if any(a.size and float(np.abs(a).max()) > self.max_value for a in arrays):
            return "value_above_max"
        exact = update.classes and update.privacy.mechanism == "none"
        if exact and any(c != int(c) for c in update.counts):
            return "fractional_count"  # samples come whole; only noise makes a fraction
        if exact and self.unit_means and longer_than_unit(update.prototypes):
            return "impossible_norm"
        return None

    def wrong_basis(self, update: PrototypeUpdate) -> bool:
        """Statistics made in another basis than the fleet's public projection (or with no
        basis check): summed with the others', they would turn the head to noise."""
        basis = update.extras.get(BASIS)
        if basis is None:
            problem: str | None = "no basis check"
        elif self.features and basis.size and basis[0] != self.features:
            problem = f"a feature size of {basis[0]:g}, model.feature_dim is {self.features}"
        else:
            problem = basis_problem(self.fleet, basis, self.dim, public=self.basis)
        if problem is not None:  # counted as wrong_basis; the why at DEBUG, as other refusals
            log.debug("%s: statistics in another basis (%s)", update.client, problem)
        return problem is not None

    def statistics_problem(self, update: PrototypeUpdate) -> str | None:
        """A closed-form update's statistics against what the fleet says its devices send
        (coordinator/statistics_checks.py): exactly the arrays the coordinator sums (the
        counts as drawn, the class sums, the second moment), held to one device's bounds."""
        if not update.classes:
            return None  # statistics sent before: nothing new to check or sum
        noisy = update.privacy.mechanism != "none"
        if noisy == self.release.exact:
            return "wrong_release"
        largest = self.release.largest_value
        # The basis check is public and holds the feature size, not a statistic.
        arrays = (update.prototypes, *(a for n, a in update.extras.items() if n != BASIS))
        if any(a.size and float(np.abs(a).max()) > largest for a in arrays):
            return "value_above_max"
        drawn = np.asarray(update.extras[COUNTS], dtype=np.float64)
        # The counts field is the counts as drawn, clamped at zero (edge_agent/closed_form.py).
        if not np.array_equal(np.asarray(update.counts, dtype=np.float64), np.maximum(drawn, 0)):
            return "implausible_statistics"
        gram = update.extras.get(GRAM)
        return statistics_problem(drawn, update.prototypes, gram, self.release)

    def _extras_mismatch(self, update: PrototypeUpdate) -> bool:
        got = {name: a.shape for name, a in update.extras.items()}
        if self.statistics:
            # No rows (statistics sent before): nothing beside them; else the counts
            # as drawn, one per row, and the method's second moment.
            want = {COUNTS: (len(update.classes),), BASIS: (self.dim + 1,), **(self.extras or {})}
            return got != (want if update.classes else {})
        if self.extras is None:
            return got != {FISHER: update.prototypes.shape}
        return got != dict(self.extras)


def longer_than_unit(prototypes: np.ndarray) -> bool:
    """A row no mean of unit vectors can be: longer than 1 beyond rounding. A noised
    release is not held to this (its noise lengthens every row); the aggregation's median
    clip bounds it instead (coordinator/aggregate.py::clip_norms_at_median)."""
    rows = np.asarray(prototypes, dtype=np.float64)
    return bool(rows.size) and float(np.linalg.norm(rows, axis=1).max()) > 1.0 + NORM_TOLERANCE
