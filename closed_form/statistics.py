"""Class statistics: one device's counts, class sums and Gram matrix of its clipped rows
(or, for FedCOF, of its class means and counts alone), and :func:`merge`, their sum over
devices, which is what the coordinator keeps."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from closed_form.arrays import (
    F64,
    I64,
    checked_labels,
    checked_rows,
    float_array,
    frozen,
)
from closed_form.triangles import from_upper_triangle, upper_triangle


def clip_rows(x: npt.ArrayLike, bound: float = 1.0) -> F64:
    """Each row scaled down to L2 norm <= ``bound``; shorter rows and zero rows unchanged.

    The sensitivity of every release (closed_form/privacy.py) assumes rows of norm
    <= 1, so devices clip before they sum. (Scaling may leave a norm one ulp above
    ``bound``; the released sums are noised far above that.)
    """
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"bound must be a positive finite number, got {bound!r}")
    rows = np.asarray(x, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"clip_rows needs a 2-D array of rows, got shape {rows.shape}")
    norms = np.linalg.norm(rows, axis=1)
    scale = np.ones_like(norms)
    over = norms > bound
    scale[over] = bound / norms[over]
    return rows * scale[:, None]


# eq=False: the fields are arrays, whose == is elementwise, so a generated __eq__/__hash__
# would raise; identity equality is the honest one for a bag of arrays.
@dataclass(frozen=True, eq=False)
class Statistics:
    """Class statistics summed over ``devices`` devices (one device: ``devices == 1``).

    ``counts`` (C,) is ``N_c``; ``sums`` (C, k) is ``s_c``, the sum of the rows of class c;
    ``gram`` (k, k) is ``sum x x^T`` over all rows, or None for a release that carries none
    (FedCOF); ``holders`` (C,) int64 counts the devices holding class c (count > 0), which
    FedCOF needs to turn the spread of the devices' means into a covariance; ``scatter``
    (C, k, k) is, per class, the sum over devices of ``n_dc * mu_dc mu_dc^T`` (FedCOF only,
    built from device class means and counts), else None.

    Counts are not required to be non-negative: a noised release may dip below zero until
    :func:`denoise` cleans it. Arrays are stored as read-only float64/int64 copies.
    """

    counts: F64
    sums: F64
    gram: F64 | None
    holders: I64
    scatter: F64 | None
    devices: int

    def __post_init__(self) -> None:
        sums = np.asarray(self.sums)
        if sums.ndim != 2:
            raise ValueError(f"sums must have shape (C, k), got {sums.shape}")
        c, k = sums.shape
        object.__setattr__(self, "sums", float_array("sums", sums, (c, k)))
        object.__setattr__(self, "counts", float_array("counts", self.counts, (c,)))
        if self.gram is not None:
            gram = float_array("gram", self.gram, (k, k))
            scale = max(1.0, float(np.abs(gram).max(initial=0.0)))
            if np.abs(gram - gram.T).max(initial=0.0) > 1e-9 * scale:
                raise ValueError("gram is not symmetric")
            object.__setattr__(self, "gram", gram)
        if self.scatter is not None:
            object.__setattr__(self, "scatter", float_array("scatter", self.scatter, (c, k, k)))
        if isinstance(self.devices, bool) or not isinstance(self.devices, int | np.integer):
            raise ValueError(f"devices must be an integer, got {self.devices!r}")
        if self.devices < 0:
            raise ValueError(f"devices must be >= 0, got {self.devices}")
        object.__setattr__(self, "devices", int(self.devices))
        holders = np.asarray(self.holders)
        if holders.shape != (c,):
            raise ValueError(f"holders has shape {holders.shape}, expected ({c},)")
        if c and not np.issubdtype(holders.dtype, np.integer):
            raise ValueError(f"holders must be integers, got dtype {holders.dtype}")
        if c and (holders.min() < 0 or holders.max() > self.devices):
            raise ValueError(
                f"holders must lie in [0, devices={self.devices}], "
                f"got {holders.min()}..{holders.max()}"
            )
        object.__setattr__(self, "holders", frozen(holders.astype(np.int64, copy=True)))

    @property
    def num_classes(self) -> int:
        return int(self.sums.shape[0])

    @property
    def dim(self) -> int:
        return int(self.sums.shape[1])

    @classmethod
    def empty(
        cls, *, num_classes: int, dim: int, gram: bool = True, scatter: bool = False
    ) -> Statistics:
        """Zero statistics of no device: the identity of :func:`merge`."""
        if num_classes < 1 or dim < 1:
            raise ValueError(f"need num_classes >= 1 and dim >= 1, got {num_classes}, {dim}")
        return cls(
            counts=np.zeros(num_classes),
            sums=np.zeros((num_classes, dim)),
            gram=np.zeros((dim, dim)) if gram else None,
            holders=np.zeros(num_classes, dtype=np.int64),
            scatter=np.zeros((num_classes, dim, dim)) if scatter else None,
            devices=0,
        )


def device_statistics(
    x: npt.ArrayLike, labels: npt.ArrayLike, num_classes: int, *, gram: bool = True
) -> Statistics:
    """One device's exact statistics of its rows (already clipped by the caller).

    The Gram matrix is built from its upper triangle, so it is exactly symmetric and sums
    of such matrices stay so.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    rows = checked_rows(x)
    lab = checked_labels(labels, rows.shape[0], num_classes)
    counts = np.bincount(lab, minlength=num_classes).astype(np.float64)
    sums = np.zeros((num_classes, rows.shape[1]), dtype=np.float64)
    np.add.at(sums, lab, rows)
    return Statistics(
        counts=counts,
        sums=sums,
        gram=from_upper_triangle(upper_triangle(rows.T @ rows)) if gram else None,
        holders=(counts > 0).astype(np.int64),
        scatter=None,
        devices=1,
    )


def means_statistics(counts: npt.ArrayLike, means: npt.ArrayLike) -> Statistics:
    """One device's FedCOF statistics from its class counts (C,) and class means (C, k) alone.

    Means of classes the device lacks (count 0) are ignored, so they may be anything.
    """
    n = np.asarray(counts, dtype=np.float64)
    mu = np.asarray(means, dtype=np.float64)
    if n.ndim != 1 or mu.ndim != 2 or mu.shape[0] != n.shape[0]:
        raise ValueError(f"need counts (C,) and means (C, k), got {n.shape} and {mu.shape}")
    if not np.isfinite(n).all() or (n < 0).any():
        raise ValueError("counts must be finite and non-negative")
    held = n > 0
    mu = np.where(held[:, None], mu, 0.0)
    if not np.isfinite(mu).all():
        raise ValueError("means of held classes must be finite")
    return Statistics(
        counts=n,
        sums=n[:, None] * mu,
        gram=None,
        holders=held.astype(np.int64),
        scatter=np.einsum("c,ci,cj->cij", n, mu, mu),
        devices=1,
    )


class StatisticsSum:
    """The running sum of class statistics: every sum of devices' statistics in the project
    is taken with it (the coordinator's fleet and round totals, a worker's part, a secure
    fleet's sum of rounds, :func:`merge`), so they all add in the same order and agree to
    the bit. Added to (and taken from, ``sign=-1``) in place: a fleet of ten thousand
    devices adds ten thousand second moments a round, which copies would multiply.

    Its kind is fixed at the start: whether it carries a second moment (LDA, ridge) and
    whether a scatter (FedCOF); a part of another shape or kind is refused.
    """

    def __init__(self, *, num_classes: int, dim: int, gram: bool, scatter: bool) -> None:
        self.counts = np.zeros(num_classes)
        self.sums = np.zeros((num_classes, dim))
        self.gram = np.zeros((dim, dim)) if gram else None
        self.scatter = np.zeros((num_classes, dim, dim)) if scatter else None
        self.holders = np.zeros(num_classes, dtype=np.int64)
        self.devices = 0

    @classmethod
    def like(cls, part: Statistics) -> StatisticsSum:
        """An empty sum of ``part``'s shape and kind."""
        return cls(num_classes=part.num_classes, dim=part.dim, gram=part.gram is not None,
                   scatter=part.scatter is not None)  # fmt: skip

    @classmethod
    def of(cls, part: Statistics) -> StatisticsSum:
        """A sum that starts as a copy of ``part`` (not 0 + ``part``: a -0.0 stays one)."""
        out = cls.like(part)
        out.counts, out.sums = np.array(part.counts), np.array(part.sums)
        out.gram = None if part.gram is None else np.array(part.gram)
        out.scatter = None if part.scatter is None else np.array(part.scatter)
        out.holders, out.devices = np.array(part.holders), part.devices
        return out

    def add(self, part: Statistics, *, sign: int = 1) -> None:
        """``part`` added in place (taken out with ``sign=-1``)."""
        c, k = self.sums.shape
        if (part.num_classes, part.dim) != (c, k):
            raise ValueError(
                f"statistics of {part.num_classes} classes x dim {part.dim} added to a sum "
                f"of {c} x {k}"
            )
        if (part.gram is None) != (self.gram is None):
            raise ValueError("statistics that disagree on carrying a gram")
        if (part.scatter is None) != (self.scatter is None):
            raise ValueError("statistics that disagree on carrying a scatter")
        self.counts += sign * part.counts
        self.sums += sign * part.sums
        if self.gram is not None and part.gram is not None:
            self.gram += sign * part.gram
        if self.scatter is not None and part.scatter is not None:
            self.scatter += sign * part.scatter
        self.holders += sign * part.holders
        self.devices += sign * part.devices

    def plus(self, other: StatisticsSum) -> StatisticsSum:
        """A new sum: this one and ``other`` (neither changed)."""
        out = StatisticsSum(num_classes=0, dim=0, gram=False, scatter=False)
        for name in ("counts", "sums", "gram", "scatter", "holders"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(out, name, None if mine is None else mine + theirs)
        out.devices = self.devices + other.devices
        return out

    def total(self) -> Statistics:
        """The sum as statistics (of no device while nothing is in it)."""
        return Statistics(counts=self.counts, sums=self.sums, gram=self.gram,
                          holders=self.holders, scatter=self.scatter,
                          devices=self.devices)  # fmt: skip

    def statistics(self) -> Statistics | None:
        """The sum as statistics, None when no device's is in it."""
        return self.total() if self.devices > 0 else None


def merge(parts: Iterable[Statistics]) -> Statistics:
    """The sum of every field (devices added), with :class:`StatisticsSum`: the fleet's
    statistics.

    Sums are associative and commutative, so any grouping or order of the devices gives the
    same result up to float64 rounding. Refuses an empty input and parts that disagree on
    shape or on carrying a gram / scatter.
    """
    items = iter(parts)
    first = next(items, None)
    if first is None:
        raise ValueError("merge needs at least one Statistics")
    total = StatisticsSum.of(first)
    for i, part in enumerate(items, start=1):
        try:
            total.add(part)
        except ValueError as exc:
            raise ValueError(f"part {i}: {exc}") from exc
    return total.total()
