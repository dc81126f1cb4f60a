"""Closed-form linear heads from class statistics that a fleet adds up exactly.

On clipped frozen features (rows of norm <= 1) a device holds, per class ``c``, the count
``N_c`` and the feature sum ``s_c``, and over all its rows the Gram matrix ``G = sum x x^T``.
Every one of these is a plain sum, so the coordinator's sum over devices is exactly what one
device holding all the rows would have computed: the heads below (LDA, Fed3R ridge) are then
the pooled heads, up to float64 rounding, whatever the split of the data. FedCOF sends less
(class means and counts only) and estimates the class covariances from the spread of the
devices' means, which is only as good as the number of devices holding each class.

The coordinator (sum, then solve) and the device (its own head, a personalised one) both
import this module, so it is numpy only and pure: no state, no seeds, no I/O.

Notation: ``k`` the feature dimension, ``C`` the number of classes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

F64: TypeAlias = npt.NDArray[np.float64]
I64: TypeAlias = npt.NDArray[np.int64]
Bools: TypeAlias = npt.NDArray[np.bool_]

#: L2 sensitivity of one device's released (upper triangle of G, s, n) under add/remove of one
#: example of norm <= 1; see :func:`sensitivity_bound`.
SENSITIVITY = math.sqrt(3.0)

# Added to the shrunk covariance, relative to its average eigenvalue, so that a rank-deficient
# estimate (fewer samples than dimensions, shrinkage 0) still solves; small enough to change
# a well-conditioned head by far less than the float64 noise of summing the statistics.
_RIDGE_FLOOR = 1e-12


# --------------------------------------------------------------------------- triangles


def triangle_size(k: int) -> int:
    """Entries of the upper triangle (with diagonal) of a ``k x k`` matrix: ``k(k+1)/2``."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
        raise ValueError(f"dimension must be a non-negative integer, got {k!r}")
    return int(k) * (int(k) + 1) // 2


def dim_of_triangle(n: int) -> int:
    """The ``k`` with ``triangle_size(k) == n``; ValueError when ``n`` is not triangular."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"triangle length must be a non-negative integer, got {n!r}")
    k = (math.isqrt(8 * int(n) + 1) - 1) // 2
    if triangle_size(k) != n:
        raise ValueError(f"{n} is not a triangular number k(k+1)/2, so not an upper triangle")
    return k


def upper_triangle(g: npt.ArrayLike) -> F64:
    """The upper triangle of a square matrix, diagonal included, in ``np.triu_indices`` order.

    This is the released form of a Gram matrix: the lower half repeats it, and sending it
    would both double the bytes and (under noise) break the symmetry.
    """
    m = np.asarray(g, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"upper_triangle needs a square matrix, got shape {m.shape}")
    return m[np.triu_indices(m.shape[0])]


def from_upper_triangle(v: npt.ArrayLike) -> F64:
    """The symmetric matrix whose upper triangle (``np.triu_indices`` order) is ``v``."""
    flat = np.asarray(v, dtype=np.float64)
    if flat.ndim != 1:
        raise ValueError(f"from_upper_triangle needs a flat vector, got shape {flat.shape}")
    k = dim_of_triangle(flat.shape[0])
    rows, cols = np.triu_indices(k)
    out = np.zeros((k, k), dtype=np.float64)
    out[rows, cols] = flat
    out[cols, rows] = flat
    return out


def clip_rows(x: npt.ArrayLike, bound: float = 1.0) -> F64:
    """Each row scaled down to L2 norm <= ``bound``; shorter rows and zero rows unchanged.

    The sensitivity of every release below assumes rows of norm <= 1, so devices clip
    before they sum. (Scaling may leave a norm one ulp above ``bound``; the released sums
    are noised far above that.)
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


# --------------------------------------------------------------------------- statistics


def _frozen(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a.setflags(write=False)
    return a


def _float_array(name: str, value: object, shape: tuple[int, ...]) -> F64:
    """A read-only float64 copy of ``value`` of exactly ``shape``, every entry finite."""
    try:
        arr = np.array(value, dtype=np.float64, copy=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not a numeric array: {exc}") from exc
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} has non-finite entries")
    return _frozen(arr)


def _labels(labels: npt.ArrayLike, rows: int, num_classes: int) -> I64:
    lab = np.asarray(labels)
    if lab.shape != (rows,):
        raise ValueError(f"labels have shape {lab.shape}, expected ({rows},) to match the rows")
    if rows and not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {lab.dtype}")
    lab = lab.astype(np.int64)
    if rows and (lab.min() < 0 or lab.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got {lab.min()}..{lab.max()}")
    return lab


def _rows(x: npt.ArrayLike, name: str = "x") -> F64:
    rows = np.asarray(x, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array of feature rows, got shape {rows.shape}")
    if not np.isfinite(rows).all():
        raise ValueError(f"{name} has non-finite entries")
    return rows


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
        object.__setattr__(self, "sums", _float_array("sums", sums, (c, k)))
        object.__setattr__(self, "counts", _float_array("counts", self.counts, (c,)))
        if self.gram is not None:
            gram = _float_array("gram", self.gram, (k, k))
            scale = max(1.0, float(np.abs(gram).max(initial=0.0)))
            if np.abs(gram - gram.T).max(initial=0.0) > 1e-9 * scale:
                raise ValueError("gram is not symmetric")
            object.__setattr__(self, "gram", gram)
        if self.scatter is not None:
            object.__setattr__(self, "scatter", _float_array("scatter", self.scatter, (c, k, k)))
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
        object.__setattr__(self, "holders", _frozen(holders.astype(np.int64, copy=True)))

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
    rows = _rows(x)
    lab = _labels(labels, rows.shape[0], num_classes)
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


def merge(parts: Iterable[Statistics]) -> Statistics:
    """The elementwise sum of every field (devices added): the fleet's statistics.

    Sums are associative and commutative, so any grouping or order of the devices gives the
    same result up to float64 rounding. Refuses an empty input and parts that disagree on
    shape or on carrying a gram / scatter.
    """
    items = list(parts)
    if not items:
        raise ValueError("merge needs at least one Statistics")
    first = items[0]
    for i, part in enumerate(items[1:], start=1):
        if (part.num_classes, part.dim) != (first.num_classes, first.dim):
            raise ValueError(
                f"part {i} has {part.num_classes} classes x dim {part.dim}, "
                f"part 0 has {first.num_classes} x {first.dim}"
            )
        if (part.gram is None) != (first.gram is None):
            raise ValueError(f"part {i} and part 0 disagree on carrying a gram")
        if (part.scatter is None) != (first.scatter is None):
            raise ValueError(f"part {i} and part 0 disagree on carrying a scatter")
    counts = np.array(first.counts)
    sums = np.array(first.sums)
    holders = np.array(first.holders)
    gram = None if first.gram is None else np.array(first.gram)
    scatter = None if first.scatter is None else np.array(first.scatter)
    for part in items[1:]:
        counts += part.counts
        sums += part.sums
        holders += part.holders
        if gram is not None and part.gram is not None:
            gram += part.gram
        if scatter is not None and part.scatter is not None:
            scatter += part.scatter
    return Statistics(
        counts=counts,
        sums=sums,
        gram=gram,
        holders=holders,
        scatter=scatter,
        devices=sum(part.devices for part in items),
    )


# --------------------------------------------------------------------------- heads


@dataclass(frozen=True, eq=False)
class LinearHead:
    """Scores ``x @ weight.T + bias`` over C classes; classes not ``present`` never win."""

    weight: F64  # (C, k)
    bias: F64  # (C,)
    present: Bools  # (C,)

    def __post_init__(self) -> None:
        weight = np.asarray(self.weight)
        if weight.ndim != 2:
            raise ValueError(f"weight must have shape (C, k), got {weight.shape}")
        c, k = weight.shape
        object.__setattr__(self, "weight", _float_array("weight", weight, (c, k)))
        object.__setattr__(self, "bias", _float_array("bias", self.bias, (c,)))
        present = np.asarray(self.present)
        if present.shape != (c,) or present.dtype != np.bool_:
            raise ValueError(
                f"present must be a bool array of shape ({c},), got {present.dtype} {present.shape}"
            )
        if not present.any():
            raise ValueError("a head needs at least one present class")
        object.__setattr__(self, "present", _frozen(present.copy()))

    @property
    def num_classes(self) -> int:
        return int(self.weight.shape[0])

    @property
    def dim(self) -> int:
        return int(self.weight.shape[1])

    def scores(self, x: npt.ArrayLike) -> F64:
        """(N, C) linear scores, ``-inf`` for absent classes."""
        rows = _rows(x)
        if rows.shape[1] != self.dim:
            raise ValueError(f"x has {rows.shape[1]} features, the head expects {self.dim}")
        out: F64 = rows @ self.weight.T + self.bias
        out[:, ~self.present] = -np.inf
        return out

    def predict(self, x: npt.ArrayLike) -> I64:
        """(N,) the highest-scoring present class of each row."""
        return np.argmax(self.scores(x), axis=1).astype(np.int64)


def oas_shrinkage(cov: npt.ArrayLike, n: float) -> float:
    """Oracle Approximating Shrinkage weight toward ``tr(cov)/k * I`` (Chen et al. 2010).

    Computed from the covariance estimate and the sample count alone, with the formula of
    scikit-learn's ``OAS`` (including its 0 for a single feature, where shrinkage toward the
    scalar target changes nothing). OAS rather than Ledoit-Wolf because Ledoit-Wolf's weight
    needs fourth moments of the rows (``sum ||x||^4``-type terms) that the summed statistics
    (counts, sums, Gram) do not carry; OAS needs only the covariance, so the coordinator can
    compute it from the fleet's sums.
    """
    s = np.asarray(cov, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or s.shape[0] == 0:
        raise ValueError(f"cov must be a non-empty square matrix, got shape {s.shape}")
    if not np.isfinite(s).all():
        raise ValueError("cov has non-finite entries")
    if not (math.isfinite(n) and n > 0):
        raise ValueError(f"n must be a positive sample count, got {n!r}")
    p = s.shape[0]
    if p == 1:
        return 0.0
    mu = float(np.trace(s)) / p
    alpha = float(np.mean(s**2))
    num = alpha + mu**2
    den = (n + 1.0) * (alpha - mu**2 / p)
    return 1.0 if den == 0 else min(num / den, 1.0)


def _present(stats: Statistics) -> Bools:
    present = stats.counts > 0
    if not present.any():
        raise ValueError("no class has a positive count: nothing to classify")
    return present


def _solve(a: F64, b: F64, what: str) -> F64:
    try:
        out = np.asarray(np.linalg.solve(a, b), dtype=np.float64)
    except np.linalg.LinAlgError as exc:
        raise ValueError(f"{what} is singular: {exc}") from exc
    return out


def lda_head(stats: Statistics, *, shrinkage: float | None = None) -> LinearHead:
    """Linear discriminant analysis with a shared, shrunk covariance. Needs ``stats.gram``.

    ``mu_c = s_c / N_c``; within-class scatter ``W = G - sum_c N_c mu_c mu_c^T``;
    ``Sigma = W / max(N - C_present, 1)``, made positive semi-definite, then shrunk toward
    ``tr(Sigma)/k * I`` with weight ``shrinkage`` (OAS from ``Sigma`` and ``N`` when None).
    Score of class c: ``x^T Sigma_s^-1 mu_c - mu_c^T Sigma_s^-1 mu_c / 2 + log(N_c / N)``.

    Why PSD here and not only on ``G``: with noisy statistics ``G`` can be PSD while ``W``,
    ``G`` less the noisy means' outer products, is not, along the class means' directions,
    and a covariance that is negative there turns ``Sigma^-1 mu_c`` away from ``mu_c`` (a
    head below chance). Exact statistics give a PSD ``W`` up to rounding, which the
    clipping leaves as it is.
    """
    if stats.gram is None:
        raise ValueError("lda_head needs a gram; this release carries none (FedCOF: fedcof_head)")
    if shrinkage is not None and not (0.0 <= shrinkage <= 1.0):
        raise ValueError(f"shrinkage must lie in [0, 1], got {shrinkage!r}")
    present = _present(stats)
    n_c = stats.counts[present]
    n = float(n_c.sum())
    mu = stats.sums[present] / n_c[:, None]  # (Cp, k)
    within = stats.gram - (mu.T * n_c) @ mu
    sigma = _psd(within / max(n - int(present.sum()), 1.0))
    k = stats.dim
    rho = oas_shrinkage(sigma, n) if shrinkage is None else float(shrinkage)
    tau = float(np.trace(sigma)) / k
    if tau <= 0:  # nothing to scale the target by (no spread, or noise): the identity
        tau = 1.0
    shrunk = (1.0 - rho) * sigma + (rho + _RIDGE_FLOOR) * tau * np.eye(k)
    w = _solve(shrunk, mu.T, "the shrunk covariance").T  # (Cp, k)
    weight = np.zeros((stats.num_classes, k))
    bias = np.zeros(stats.num_classes)
    weight[present] = w
    bias[present] = -0.5 * np.einsum("ck,ck->c", mu, w) + np.log(n_c / n)
    return LinearHead(weight=weight, bias=bias, present=present)


def _psd(m: F64) -> F64:
    """``m`` symmetrised, its negative eigenvalues set to 0; as it is (symmetrised) when a
    Cholesky factorisation shows it positive definite already, the cheap common case."""
    sym = (m + m.T) / 2.0
    try:
        np.linalg.cholesky(sym)
        return sym
    except np.linalg.LinAlgError:
        values, vectors = np.linalg.eigh(sym)
        psd = (vectors * np.maximum(values, 0.0)) @ vectors.T
        return (psd + psd.T) / 2.0


def _ridge(gram: F64, sums: F64, present: Bools, lam: float) -> LinearHead:
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be a non-negative finite number, got {lam!r}")
    k = gram.shape[0]
    weight = _solve(gram + lam * np.eye(k), sums.T, "G + lam I").T
    return LinearHead(weight=weight, bias=np.zeros(sums.shape[0]), present=present)


def ridge_head(stats: Statistics, *, lam: float = 0.1) -> LinearHead:
    """Fed3R: ``weight^T = (G + lam I)^-1 [s_1 ... s_C]``, no bias. Needs ``stats.gram``.

    This is least squares of one-hot targets on the rows (``X^T Y = [s_1 ... s_C]``).
    """
    if stats.gram is None:
        raise ValueError("ridge_head needs a gram; this release carries none (use fedcof_head)")
    return _ridge(stats.gram, stats.sums, _present(stats), lam)


def fedcof_covariances(stats: Statistics) -> F64:
    """(C, k, k) FedCOF's per-class covariance from the spread of the devices' class means.

    ``Sigma_c = (scatter_c - N_c mu_c mu_c^T) / (K_c - 1)`` with ``K_c`` the devices holding
    c, which equals ``sum_d n_dc (mu_dc - mu_c)(mu_dc - mu_c)^T / (K_c - 1)``. Since
    ``Var(mu_dc) ~ Sigma_c / n_dc``, each term estimates ``Sigma_c`` and the sum estimates
    ``(K_c - 1) Sigma_c``: unbiased for i.i.d. devices, but only useful with many of them
    (with few, ``Sigma_c`` has rank <= K_c - 1). ``Sigma_c = 0`` when ``K_c < 2``: one
    device's mean says nothing of the spread. Needs ``stats.scatter``.
    """
    if stats.scatter is None:
        raise ValueError("FedCOF needs a scatter: build each device's part with means_statistics")
    k = stats.dim
    out = np.zeros((stats.num_classes, k, k))
    for c in range(stats.num_classes):
        n_c, holders = float(stats.counts[c]), int(stats.holders[c])
        if n_c <= 0 or holders < 2:
            continue
        mean_outer = np.outer(stats.sums[c], stats.sums[c]) / n_c  # N_c mu_c mu_c^T
        cov = (stats.scatter[c] - mean_outer) / (holders - 1)
        out[c] = (cov + cov.T) / 2.0
    return out


def fedcof_gram(stats: Statistics) -> F64:
    """The Gram matrix implied by means and counts alone (FedCOF). Needs ``stats.scatter``.

    ``G = sum_c [(N_c - 1) Sigma_c + N_c mu_c mu_c^T]`` with ``Sigma_c`` from
    :func:`fedcof_covariances` (see there why it needs many devices per class).
    """
    covs = fedcof_covariances(stats)
    gram = np.zeros((stats.dim, stats.dim))
    for c in range(stats.num_classes):
        n_c = float(stats.counts[c])
        if n_c <= 0:
            continue
        gram += max(n_c - 1.0, 0.0) * covs[c] + np.outer(stats.sums[c], stats.sums[c]) / n_c
    out: F64 = (gram + gram.T) / 2.0
    return out


def fedcof_head(stats: Statistics, *, lam: float = 0.1) -> LinearHead:
    """The ridge form of :func:`ridge_head` on :func:`fedcof_gram` and the class sums."""
    return _ridge(fedcof_gram(stats), stats.sums, _present(stats), lam)


def personalised_head(
    x: npt.ArrayLike, labels: npt.ArrayLike, global_head: LinearHead, *, lam: float = 1.0
) -> LinearHead:
    """A device's closed-form ridge on its own rows, pulled toward the global head.

    Targets are one-hot. The global head's scores live on their own scale (LDA's are
    log-odds, ridge's are near [0, 1]), so it is first brought to the target scale by the
    scalars ``a, b`` minimising ``||a L + b - Y||^2`` over the device's rows (``L`` the
    global scores, absent classes at 0; ``a = 1, b = 0`` with fewer than 2 rows or constant
    ``L``). Then with ``X~ = [x, 1]`` and ``Theta_0 = [a weight^T; a bias + b]``:
    ``Theta = (X~^T X~ + lam I)^-1 (X~^T Y + lam Theta_0)``. ``lam -> inf`` gives the
    rescaled global head (same predictions when ``a > 0``), ``lam -> 0`` the device's own
    least squares.
    """
    if not (math.isfinite(lam) and lam > 0):
        raise ValueError(f"lam must be a positive finite number, got {lam!r}")
    rows = _rows(x)
    if rows.shape[1] != global_head.dim:
        raise ValueError(f"x has {rows.shape[1]} features, the head expects {global_head.dim}")
    c, k = global_head.num_classes, global_head.dim
    lab = _labels(labels, rows.shape[0], c)
    targets = np.zeros((rows.shape[0], c))
    targets[np.arange(rows.shape[0]), lab] = 1.0
    logits = rows @ global_head.weight.T + global_head.bias
    logits[:, ~global_head.present] = 0.0
    a, b = _affine_fit(logits, targets)
    theta0 = np.vstack([a * global_head.weight.T, a * global_head.bias + b])  # (k+1, C)
    design = np.hstack([rows, np.ones((rows.shape[0], 1))])  # (N, k+1)
    theta = _solve(
        design.T @ design + lam * np.eye(k + 1),
        design.T @ targets + lam * theta0,
        "the personalised system",
    )
    return LinearHead(weight=theta[:k].T, bias=theta[k], present=global_head.present)


def _affine_fit(logits: F64, targets: F64) -> tuple[float, float]:
    """Scalars ``a, b`` minimising ``||a * logits + b - targets||^2`` over every entry."""
    if logits.shape[0] < 2:
        return 1.0, 0.0
    centred = logits - logits.mean()
    var = float(np.sum(centred**2))
    if var <= 1e-12 * max(1.0, float(np.sum(logits**2))):
        return 1.0, 0.0
    a = float(np.sum(centred * (targets - targets.mean()))) / var
    return a, float(targets.mean()) - a * float(logits.mean())


# --------------------------------------------------------------------------- privacy


def sensitivity_bound() -> float:
    """L2 sensitivity of one device's release (upper triangle of G, sums, counts).

    Adding (or removing) one example x with ``||x|| <= 1`` of class c changes G by
    ``x x^T``, whose Frobenius norm is ``||x||^2 <= 1``; the released upper triangle holds a
    subset of those entries, so its change has L2 norm <= 1 too. It changes one row of the
    sums, ``s_c``, by x (norm <= 1), and one count by 1. The joint change therefore has L2
    norm at most ``sqrt(1 + 1 + 1) = sqrt(3)``, reached by any unit basis vector.
    """
    return SENSITIVITY


def release_delta(x: npt.ArrayLike, label: int, num_classes: int) -> F64:
    """The change one example makes to the flat release ``[triu(G), sums (C*k), counts (C)]``.

    ``x`` is used as given (clip it first); tests check its norm against :data:`SENSITIVITY`.
    """
    row = np.asarray(x, dtype=np.float64)
    if row.ndim != 1:
        raise ValueError(f"x must be one feature vector, got shape {row.shape}")
    if not 0 <= label < num_classes:
        raise ValueError(f"label must lie in [0, {num_classes}), got {label}")
    sums = np.zeros((num_classes, row.shape[0]))
    sums[label] = row
    counts = np.zeros(num_classes)
    counts[label] = 1.0
    return np.concatenate([upper_triangle(np.outer(row, row)), sums.ravel(), counts])


def noised(stats: Statistics, *, sigma: float, rng: np.random.Generator) -> Statistics:
    """The Gaussian mechanism: N(0, sigma^2) on every released coordinate.

    Each upper-triangle entry of the Gram matrix gets its own draw, mirrored to the lower
    half (the lower half is not released, so it carries no extra noise and the result stays
    symmetric); each entry of the sums and each count get their own. ``holders`` and
    ``devices`` are copied as they are: they are not part of what is released (a device
    sends every class under noise, and the coordinator knows only which devices sent). For (epsilon, delta)-DP pick
    ``sigma = noise_multiplier * SENSITIVITY``. A scatter is refused: the bound does not
    cover it.
    """
    if stats.gram is None:
        raise ValueError("noised needs a gram: the sensitivity bound is for (G, s, n)")
    if stats.scatter is not None:
        raise ValueError("noised does not cover a scatter (FedCOF means are not in the bound)")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a non-negative finite number, got {sigma!r}")
    tri = upper_triangle(stats.gram)
    return Statistics(
        counts=stats.counts + rng.normal(0.0, sigma, size=stats.counts.shape),
        sums=stats.sums + rng.normal(0.0, sigma, size=stats.sums.shape),
        gram=from_upper_triangle(tri + rng.normal(0.0, sigma, size=tri.shape)),
        holders=stats.holders,
        scatter=None,
        devices=stats.devices,
    )


def denoise(stats: Statistics) -> Statistics:
    """Post-processing of noisy sums (free under DP): a PSD Gram and sensible counts.

    The Gram matrix is symmetrised and its negative eigenvalues set to 0 (a true Gram matrix
    is PSD, and the heads' solves rely on it). A class whose noisy count is below 1 cannot
    hold a real example's worth of signal: it becomes absent (count 0, sum and scatter
    zeroed), so no head divides by a tiny or negative count.
    """
    absent = stats.counts < 1.0
    counts = np.where(absent, 0.0, stats.counts)
    sums = np.where(absent[:, None], 0.0, stats.sums)
    scatter = None
    if stats.scatter is not None:
        scatter = np.where(absent[:, None, None], 0.0, stats.scatter)
    gram = None
    if stats.gram is not None:
        gram = _psd(stats.gram)
    return Statistics(
        counts=counts,
        sums=sums,
        gram=gram,
        holders=stats.holders,
        scatter=scatter,
        devices=stats.devices,
    )
