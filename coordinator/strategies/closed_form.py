"""Closed-form heads from the fleet's class statistics: LDA, ridge (Fed3R) and FedCOF.

A device of these methods sends its statistics once per data version (the sums a linear
classifier is solved from: ``closed_form/``); the coordinator adds every
client's latest statistics exactly, in float64, and solves once. What it announces is the
linear classifier: its weight rows as the global prototype rows (one per class present in
the fleet) and its biases as the ``"bias"`` extra. A round in which no client sent new
statistics changes nothing: the round manager announces the same head again
(``coordinator/rounds/stored.py``).

An update's prototype rows are its per-class feature sums, ``extras["counts"]`` its
counts as drawn (signed under noise: clamping each device's at zero would inflate the
fleet's), and for LDA and ridge ``extras["gram"]`` the upper triangle of its second
moment. FedCOF's message stays prototype-sized: sums and counts, from which the
coordinator takes each device's class means.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

import closed_form as cf
from coordinator.strategies.base import Aggregate, RobustOptions, Strategy, register
from protocol import PrototypeUpdate
from protocol.methods import BIAS, COUNTS, GRAM

log = logging.getLogger(__name__)


def statistics_of(update: PrototypeUpdate, *, num_classes: int, dim: int) -> cf.Statistics:
    """One client's statistics as its update carries them (dense over the classes)."""
    counts = np.zeros(num_classes)
    sums = np.zeros((num_classes, dim))
    idx = np.asarray(update.classes, dtype=np.int64)
    counts[idx] = np.asarray(update.extras[COUNTS], dtype=np.float64)
    sums[idx] = np.asarray(update.prototypes, dtype=np.float64)
    if GRAM in update.extras:
        return cf.Statistics(
            counts=counts,
            sums=sums,
            gram=cf.from_upper_triangle(np.asarray(update.extras[GRAM], dtype=np.float64)),
            holders=(counts >= 1.0).astype(np.int64),
            scatter=None,
            devices=1,
        )
    # FedCOF: the device's class means. A class whose (noisy) count is below one holds no
    # example's worth of signal: absent from this device, so it counts as no holder.
    held = counts >= 1.0
    counts = np.where(held, counts, 0.0)
    means = np.where(held[:, None], sums / np.maximum(counts, 1.0)[:, None], 0.0)
    return cf.means_statistics(counts, means)


def fleet_statistics(
    updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
) -> cf.Statistics | None:
    """The sum of the clients' statistics (each client once), None when there are none.
    Summed in client order: the result does not depend on the order updates arrived in."""
    parts = [
        statistics_of(u, num_classes=num_classes, dim=dim)
        for u in sorted(updates, key=lambda u: u.client)
        if u.classes
    ]
    return cf.merge(parts) if parts else None


def announced(head: cf.LinearHead) -> Aggregate:
    """The head as an announcement carries it: weight rows and biases of present classes."""
    present = np.flatnonzero(head.present)
    return Aggregate(
        global_classes=tuple(int(c) for c in present),
        global_prototypes=head.weight[present],
        extras={BIAS: head.bias[present]},
    )


class ClosedForm(Strategy):
    """Sum the statistics of ``updates`` (every client's latest), post-process them (a
    no-op on exact statistics: noisy ones are symmetrised, made positive semi-definite,
    counts below one dropped) and solve."""

    def solve(self, stats: cf.Statistics, *, noise_std: float = 0.0) -> cf.LinearHead:
        """The head of ``stats``; ``noise_std``: the standard deviation of the noise on
        each summed coordinate (a secure sum's, public), 0 for exact statistics."""
        raise NotImplementedError

    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        stats = fleet_statistics(updates, num_classes=num_classes, dim=dim)
        return Aggregate() if stats is None else self.solve_statistics(stats)

    def solve_statistics(self, stats: cf.Statistics, *, noise_std: float = 0.0) -> Aggregate:
        """The announced head of the fleet's summed statistics, carrying noise of standard
        deviation ``noise_std`` on each coordinate (0: exact)."""
        if stats.gram is not None:
            stats = cf.denoise(stats)
        try:
            head = self.solve(stats, noise_std=noise_std)
        except (ValueError, np.linalg.LinAlgError) as exc:
            # Statistics no honest fleet sends (a device's bounds are the admission's,
            # not its honesty): the round closes without a head, devices keep theirs.
            log.warning("%s: no head solved from this round's statistics: %s", self.name, exc)
            return Aggregate()
        # Scaled to the announce dtype's range by the announcer (coordinator/rounds/
        # announcements.py::within_dtype), which alone knows that dtype.
        return announced(head)


@register("lda")
class LDA(ClosedForm):
    """Shared within-class covariance, shrunk toward a scaled identity by the OAS weight
    computed from the statistics themselves (``shrinkage`` fixes it instead)."""

    def __init__(
        self, *, robust: RobustOptions | None = None, shrinkage: float | None = None
    ) -> None:
        super().__init__(robust=robust)
        if shrinkage is not None and not 0.0 <= shrinkage <= 1.0:
            raise ValueError(f"shrinkage must be in [0, 1], got {shrinkage}")
        self.shrinkage = shrinkage

    def solve(self, stats: cf.Statistics, *, noise_std: float = 0.0) -> cf.LinearHead:
        return cf.lda_head(stats, shrinkage=self.shrinkage, noise_std=noise_std)


class RidgeForm(ClosedForm):
    """A head solved as ``(G + lam I)^-1 [s_1 ... s_C]`` for some ``G``."""

    def __init__(self, *, robust: RobustOptions | None = None, lam: float = 0.1) -> None:
        super().__init__(robust=robust)
        if lam <= 0:
            raise ValueError(f"lam must be positive, got {lam}")
        self.lam = lam


@register("ridge")
class Ridge(RidgeForm):
    """Fed3R: ``W = (G + lam I)^-1 [s_1 ... s_C]``, the pooled ridge solution exactly."""

    def solve(self, stats: cf.Statistics, *, noise_std: float = 0.0) -> cf.LinearHead:
        return cf.ridge_head(stats, lam=self.lam, noise_std=noise_std)


@register("fedcof")
class FedCOF(RidgeForm):
    """From class means and counts alone: the class covariances implied by the spread of
    the devices' class means (unbiased only with many devices), then the ridge form."""

    def solve(self, stats: cf.Statistics, *, noise_std: float = 0.0) -> cf.LinearHead:
        # Never summed securely (it needs each device's means): its statistics are exact
        # or each device's own release.
        return cf.fedcof_head(stats, lam=self.lam)
