"""Linear heads solved from a fleet's summed statistics: LDA with a shrunk shared
covariance, Fed3R's ridge, and FedCOF's ridge on a Gram matrix estimated from class means."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from closed_form.arrays import (
    F64,
    I64,
    Bools,
    checked_rows,
    float_array,
    frozen,
    noise_floor,
    psd,
    solve,
)
from closed_form.statistics import Statistics

# Added to the shrunk covariance, relative to its average eigenvalue, so that a rank-deficient
# estimate (fewer samples than dimensions, shrinkage 0) still solves; small enough to change
# a well-conditioned head by far less than the float64 noise of summing the statistics.
_RIDGE_FLOOR = 1e-12


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
        object.__setattr__(self, "weight", float_array("weight", weight, (c, k)))
        object.__setattr__(self, "bias", float_array("bias", self.bias, (c,)))
        present = np.asarray(self.present)
        if present.shape != (c,) or present.dtype != np.bool_:
            raise ValueError(
                f"present must be a bool array of shape ({c},), got {present.dtype} {present.shape}"
            )
        if not present.any():
            raise ValueError("a head needs at least one present class")
        object.__setattr__(self, "present", frozen(present.copy()))

    @property
    def num_classes(self) -> int:
        return int(self.weight.shape[0])

    @property
    def dim(self) -> int:
        return int(self.weight.shape[1])

    def scores(self, x: npt.ArrayLike) -> F64:
        """(N, C) linear scores, ``-inf`` for absent classes."""
        rows = checked_rows(x)
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


def lda_head(
    stats: Statistics, *, shrinkage: float | None = None, noise_std: float = 0.0
) -> LinearHead:
    """Linear discriminant analysis with a shared, shrunk covariance. Needs ``stats.gram``.

    ``mu_c = s_c / N_c``; within-class scatter ``W = G - sum_c N_c mu_c mu_c^T``, its
    eigenvalues raised to at least :func:`noise_floor` (0 for exact statistics: made
    positive semi-definite); ``Sigma = W / max(N - C_present, 1)``, then shrunk toward
    ``tr(Sigma)/k * I`` with weight ``shrinkage`` (OAS from ``Sigma`` and ``N`` when None).
    Score of class c: ``x^T Sigma_s^-1 mu_c - mu_c^T Sigma_s^-1 mu_c / 2 + log(N_c / N)``.

    ``noise_std``: the standard deviation of the independent noise on each summed
    coordinate (a private release's, public), 0 for exact statistics. Why a floor and not
    zero: the scatter's smallest eigenvalues can lie far below the noise of even a huge
    epsilon (digits-5 through the zoo, 100 devices x 50 at k 64: down to 0.03, against
    noise of standard deviation 0.05 a coordinate, whose spectral norm is about 0.8), so
    a fifth of its directions come out negative. Set to 0, then shrunk by OAS (whose
    weight, about 0.002, is what ``N`` exact rows would call for), they got the largest
    ``Sigma^-1`` of all, which turned the noise of the class means along them into the
    scores (1,000 devices x 20 at k 64, epsilon 1000: 78.5% -> 33.7%; floored, 77.1%). A
    direction the noise swamps is kept at the noise's own level instead, where
    ``Sigma^-1`` no longer amplifies it.

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
    within = psd(stats.gram - (mu.T * n_c) @ mu, floor=noise_floor(noise_std))
    sigma = within / max(n - int(present.sum()), 1.0)
    k = stats.dim
    rho = oas_shrinkage(sigma, n) if shrinkage is None else float(shrinkage)
    tau = float(np.trace(sigma)) / k
    if tau <= 0:  # nothing to scale the target by (no spread, or noise): the identity
        tau = 1.0
    shrunk = (1.0 - rho) * sigma + (rho + _RIDGE_FLOOR) * tau * np.eye(k)
    w = solve(shrunk, mu.T, "the shrunk covariance").T  # (Cp, k)
    weight = np.zeros((stats.num_classes, k))
    bias = np.zeros(stats.num_classes)
    weight[present] = w
    bias[present] = -0.5 * np.einsum("ck,ck->c", mu, w) + np.log(n_c / n)
    return LinearHead(weight=weight, bias=bias, present=present)


def _ridge(gram: F64, sums: F64, present: Bools, lam: float) -> LinearHead:
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be a non-negative finite number, got {lam!r}")
    k = gram.shape[0]
    weight = solve(gram + lam * np.eye(k), sums.T, "G + lam I").T
    return LinearHead(weight=weight, bias=np.zeros(sums.shape[0]), present=present)


def ridge_head(stats: Statistics, *, lam: float = 0.1, noise_std: float = 0.0) -> LinearHead:
    """Fed3R: ``weight^T = (G + lam I)^-1 [s_1 ... s_C]``, no bias. Needs ``stats.gram``.

    This is least squares of one-hot targets on the rows (``X^T Y = [s_1 ... s_C]``).
    ``noise_std`` as for :func:`lda_head`: ``G``'s eigenvalues are raised to at least
    :func:`noise_floor` first (a ``lam`` of 0.1 is below what a noisy sum's smallest
    eigenvalues carry).
    """
    if stats.gram is None:
        raise ValueError("ridge_head needs a gram; this release carries none (use fedcof_head)")
    gram = stats.gram
    if noise_std > 0:
        gram = psd(gram, floor=noise_floor(noise_std))
    return _ridge(gram, stats.sums, _present(stats), lam)


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
