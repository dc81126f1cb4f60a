"""The projection's size for a private closed-form release, by a public rule (issue 52).

A closed-form head is solved from the fleet's summed second moment ``G`` (k x k). Its rows
have norm 1 (closed_form/projection.py), so ``trace(G)`` is the number of rows ``N`` and
``G``'s mean eigenvalue ``N / k``. The secure sum adds independent noise of standard
deviation ``sigma`` (the plan's, per coordinate of the decoded sum) to every entry of its
triangle, a symmetric matrix whose spectral norm is about ``2 sigma sqrt(k)``. Their
ratio

    ``r(k) = (N / k) / (2 sigma(k) sqrt(k))``

says how much of the second moment survives the noise. Larger ``k`` keeps more of the
features (the exact head gains), and ``r`` falls as ``k^-1.5``; the rule takes the
largest ``k`` of :data:`GRID` with ``r(k) >= RATIO``.

Every input is public: ``N`` is the fleet's size times the declared dataset bound (never
the counts held), ``sigma`` the plan's for the fleet's quorum, colluders and epsilon
(secagg/plan.py). Nothing is tuned on a fleet's data, so the choice spends no budget.

:data:`RATIO` was derived once, on synthetic data, by bench/projection_rule_bench.py:
ten Gaussian classes in 896 dimensions through the fleet's projection, 30 to 3,000
devices of 20 rows, epsilon 0.5 to 8, the head solved from the sum with a Gaussian of the
plan's standard deviation; of the ratios ``2^(-j/2)``, the one whose choices cost the
least accuracy against the best ``k`` of each setting, on average. digits-5 through the
zoo is not used for it: that is where the rule is then measured (bench/secagg_bench.py,
bench/secagg_fleet_bench.py), against the best ``k`` picked on its test set.

A fleet with a public basis (closed_form/basis.py) takes :data:`BASIS_RATIO`, derived the
same way through a basis made from another synthetic task's rows: whitened, the second
moment's spectrum is flat, so its mean eigenvalue says more of every direction than under
the random projection, and one ratio for both lost up to 14.5 points on the random one
(a derivation run at 61af81e).
"""

from __future__ import annotations

import math

from secagg.plan import SecureSum, plan_distributed

#: The projections the rule chooses among (the closed-form benchmark's).
GRID = (8, 16, 32, 64, 128, 256, 512)
#: The least ratio of the second moment's mean eigenvalue to the noise's spectral norm
#: (module text; bench/projection_rule_bench.py derives it).
RATIO = 2.0**-3.5
#: The same for a fleet that takes its statistics in a public basis.
BASIS_RATIO = 2.0**-6.5


def noise_ratio(k: int, *, rows: int, sigma: float) -> float:
    """``r(k) = (rows / k) / (2 sigma sqrt(k))``; infinite without noise."""
    if k < 1 or rows < 0 or sigma < 0:
        raise ValueError(f"need k >= 1, rows >= 0 and sigma >= 0: {k}, {rows}, {sigma}")
    if sigma == 0:
        return math.inf
    return rows / k / (2.0 * sigma * math.sqrt(k))


def sum_sigma(k: int, *, devices: int, classes: int, epsilon: float, delta: float,
              scale: float, quorum: int, colluding: int) -> float:  # fmt: skip
    """The plan's noise per coordinate of the decoded sum of ``devices`` at ``k``."""
    release = SecureSum.of_statistics(k=k, classes=classes, scale=scale, threshold=quorum,
                                      colluding=colluding)  # fmt: skip
    plan = plan_distributed(release=release, epsilon_target=epsilon, delta=delta)
    return plan.sum_std(max(devices, quorum))


def public_dim(*, devices: int, dataset_size: int, classes: int, epsilon: float, delta: float,
               scale: float, quorum: int, colluding: int, below: int, basis: bool = False,
               ratio: float | None = None) -> int:  # fmt: skip
    """The rule's ``k`` for a secure fleet: the largest of :data:`GRID` under ``below``
    (the backbone's feature size) whose :func:`noise_ratio` is at least ``ratio``
    (:data:`BASIS_RATIO` for a fleet with a public ``basis``, else :data:`RATIO`), the
    smallest there is when none is; epsilon 0 (no noise) takes the largest."""
    least = (BASIS_RATIO if basis else RATIO) if ratio is None else ratio
    if devices < 1 or dataset_size < 1 or classes < 1:
        raise ValueError(f"need devices, dataset_size and classes >= 1: {devices}, "
                         f"{dataset_size}, {classes}")  # fmt: skip
    grid = [k for k in GRID if k < below]
    if not grid:
        raise ValueError(f"no projection of {GRID} is below the {below} features")
    if epsilon == 0:
        return grid[-1]
    rows = devices * dataset_size
    fits = [k for k in grid if noise_ratio(k, rows=rows, sigma=sum_sigma(
        k, devices=devices, classes=classes, epsilon=epsilon, delta=delta, scale=scale,
        quorum=quorum, colluding=colluding)) >= least]  # fmt: skip
    return fits[-1] if fits else grid[0]
