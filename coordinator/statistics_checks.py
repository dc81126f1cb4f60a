"""What one device's closed-form statistics can be: the checks admission holds the summed
arrays to (coordinator/admission.py), and a secure fleet's unmasked sum (the same bounds
summed over its devices, coordinator/rounds/secure_checks.py).

A device's rows have norm <= 1 (closed_form/statistics.py::clip_rows), so its exact
release ``(n, s, G)`` satisfies, whatever its data:

- every count ``n_c`` whole and ``0 <= n_c``, and ``N = sum n_c <= max_samples``, the fleet's
  public per-device bound (``[closed_form] max_samples``);
- ``||s_c|| <= n_c`` (a sum of ``n_c`` rows of norm <= 1);
- ``tr(G) = sum ||x||^2 <= N``, with equality when every row has norm exactly 1 (no
  projection: ``unit_rows``);
- the within-class scatter ``W = G - sum_c s_c s_c^T / n_c`` is positive semi-definite (it
  is the sum of ``(x - mu_c)(x - mu_c)^T``), and so is ``G``.

A noisy release (the fleet's ``[closed_form] release = "noisy"``) adds N(0, sigma^2) to
each released coordinate, sigma the plan's (``noise_multiplier`` times the release's
sensitivity). Each bound then gets an allowance of ``Z`` standard deviations of what the
noise adds to the checked quantity: a count ``Z sigma``; a class sum's norm
``sigma (sqrt(k) + Z)`` (the norm of a Gaussian vector is 1-Lipschitz in it, so it exceeds
its mean ``<= sigma sqrt(k)`` by ``Z sigma`` with probability ``<= exp(-Z^2 / 2)``); the
trace ``Z sigma sqrt(k)``; the second moment's smallest eigenvalue ``sigma (2 sqrt(k) + 2 Z)``
(a Wigner matrix's norm is about ``2 sigma sqrt(k)`` and is sqrt(2)-Lipschitz in its
entries). With ``Z = 6`` each check fails an honest release with probability below
1.6e-8 (``exp(-18)``; a single Gaussian tail at 6 sigma is 1e-9), so with C = 10 classes
(about 2C + 4 checks) an honest device's release is refused with probability below 1e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from closed_form import from_upper_triangle

#: Standard deviations of noise allowed on each checked quantity of a noisy release.
Z = 6.0


@dataclass(frozen=True)
class StatisticsBounds:
    """What the fleet's configuration says a device's release is (module text)."""

    #: The public bound on one device's samples, over all its classes.
    max_samples: float
    #: The standard deviation of the noise on each released coordinate; 0: exact.
    sigma: float = 0.0
    #: Every row has norm exactly 1 (no projection), so ``tr(G) = N``.
    unit_rows: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_samples) and self.max_samples > 0):
            raise ValueError(f"max_samples must be positive, got {self.max_samples}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")

    @property
    def exact(self) -> bool:
        return self.sigma == 0.0

    @property
    def largest_value(self) -> float:
        """No coordinate of a release exceeds this: a sum's and a second moment's entries
        are at most ``N <= max_samples``, plus the noise's allowance."""
        return self.max_samples + Z * self.sigma


def statistics_problem(
    counts: npt.ArrayLike, sums: npt.ArrayLike, gram: npt.ArrayLike | None,
    bounds: StatisticsBounds,
) -> str | None:  # fmt: skip
    """Why one device's release cannot be (a rejection reason), or None.

    ``counts`` (m,) the counts as drawn (summed), ``sums`` (m, k) the class sums of the m
    classes sent, ``gram`` the second moment's upper triangle or None (FedCOF)."""
    n = np.asarray(counts, dtype=np.float64)
    s = np.asarray(sums, dtype=np.float64)
    if bounds.exact:
        return _exact_problem(n, s, gram, bounds)
    return _noisy_problem(n, s, gram, bounds)


def _exact_problem(
    n: np.ndarray, s: np.ndarray, gram: npt.ArrayLike | None, bounds: StatisticsBounds
) -> str | None:
    if not np.array_equal(n, np.round(n)):
        return "fractional_count"  # samples come whole; only noise makes a fraction
    if (n < 0).any():
        return "negative_count"
    total = float(n.sum())
    if total > bounds.max_samples:
        return "samples_above_max"
    slack = 1e-9 * max(1.0, total)
    if (np.linalg.norm(s, axis=1) > n + slack).any():
        return "implausible_statistics"  # a class sum longer than its count
    if gram is None:
        return None
    g = from_upper_triangle(np.asarray(gram, dtype=np.float64))
    trace = float(np.trace(g))
    if trace > total + slack or (bounds.unit_rows and trace < total - slack * g.shape[0]):
        return "implausible_statistics"
    held = n > 0
    means = s[held] / n[held][:, None]
    within = g - (s[held].T @ means)  # W = G - sum_c s_c s_c^T / n_c
    # Rounding of a sum of N outer products: relative to N, scaled by the dimension.
    if smallest_eigenvalue(within) < -slack * g.shape[0]:
        return "implausible_statistics"  # no rows have a negative spread
    return None


def _noisy_problem(
    n: np.ndarray, s: np.ndarray, gram: npt.ArrayLike | None, bounds: StatisticsBounds
) -> str | None:
    sigma, k = bounds.sigma, s.shape[1] if s.ndim == 2 else 0
    if (n < -Z * sigma).any():
        return "negative_count"
    if float(n.sum()) > bounds.max_samples + Z * sigma * math.sqrt(len(n)):
        return "samples_above_max"
    # ||s_c|| <= n_c + ||noise|| and n_c <= drawn count + Z sigma.
    allowed = np.maximum(n, 0.0) + sigma * (math.sqrt(k) + 2 * Z)
    if (np.linalg.norm(s, axis=1) > allowed).any():
        return "implausible_statistics"
    if gram is None:
        return None
    g = from_upper_triangle(np.asarray(gram, dtype=np.float64))
    samples = float(np.maximum(n, 0.0).sum()) + Z * sigma * math.sqrt(len(n))
    if float(np.trace(g)) > samples + Z * sigma * math.sqrt(k):
        return "implausible_statistics"
    if smallest_eigenvalue(g) < -sigma * (2 * math.sqrt(k) + 2 * Z):
        return "implausible_statistics"
    return None


def smallest_eigenvalue(m: np.ndarray) -> float:
    """The smallest eigenvalue of the symmetric part of ``m`` (0 for an empty one)."""
    if m.size == 0:
        return 0.0
    return float(np.linalg.eigvalsh((m + m.T) / 2.0)[0])
