"""Differential privacy of a release: the sensitivity of one device's (G, s, n) to one
example, the Gaussian mechanism on it, and the post-processing that cleans a noisy sum."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from closed_form.arrays import F64, psd
from closed_form.statistics import Statistics
from closed_form.triangles import from_upper_triangle, upper_triangle

#: L2 sensitivity of one device's released (upper triangle of G, s, n) under add/remove of one
#: example of norm <= 1; see :func:`sensitivity_bound`.
SENSITIVITY = math.sqrt(3.0)


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
        gram = psd(stats.gram)
    return Statistics(
        counts=counts,
        sums=sums,
        gram=gram,
        holders=stats.holders,
        scatter=scatter,
        devices=stats.devices,
    )
