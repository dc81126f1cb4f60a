"""Auditing the release: an empirical lower bound on epsilon, and a label-inference attack.

Canary audit (after Jagielski et al. 2020): run the release mechanism many times on a
data set D of unit embeddings, in half of the runs with one extra known example (the
canary) added. An attacker sees only what leaves the device (prototype and rounded count)
and thresholds a statistic; with true and false positive rates TPR and FPR,

    epsilon >= ln((TPR - delta) / FPR)

for any (epsilon, delta)-DP mechanism. Clopper-Pearson 95% bounds on both rates (TPR from
below, FPR from above) make the bound hold with that confidence; the threshold is chosen
on one half of the runs and evaluated on the other, so choosing it costs no validity.
A bound above the claimed epsilon proves the claim wrong; the deliberately broken
mechanism here (noise scaled by 1 / true count) shows the audit can fail.

Both formal releases are audited: ``dp`` releases sums of the head's unit embeddings,
``dp-features`` sums of raw backbone features, which the mechanism clips to norm <= 1
(``space="features"`` draws vectors of norms up to 3, and a canary of norm 3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edge_agent.privacy.accounting import epsilon, release_event
from edge_agent.privacy.mechanisms import MechanismParams, Release, release_dp

Releaser = Callable[[np.ndarray, np.ndarray, int, MechanismParams, np.random.Generator], Release]


def release_broken(z: np.ndarray, labels: np.ndarray, num_classes: int,
                   params: MechanismParams, rng: np.random.Generator) -> Release:  # fmt: skip
    """DELIBERATELY BROKEN, for the audit only: the noise is divided by the true count,
    so a class with many examples gets almost none."""
    n = max(1, len(labels))
    scaled = MechanismParams(sum_sigma=params.sum_sigma / n, count_sigma=params.count_sigma / n)
    return release_dp(z, labels, num_classes, scaled, rng)


def clopper_pearson(
    successes: int, trials: int, *, confidence: float = 0.95
) -> tuple[float, float]:
    """Two-sided exact binomial interval."""
    from scipy.stats import beta

    alpha = 1 - confidence
    low = 0.0 if successes == 0 else float(beta.ppf(alpha / 2, successes, trials - successes + 1))
    high = (
        1.0
        if successes == trials
        else float(beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    )
    return low, high


@dataclass(frozen=True)
class AuditResult:
    epsilon_lower_bound: float
    epsilon_claimed: float
    runs: int
    threshold: float
    tpr: float
    fpr: float


def _statistic(release: Release, canary: np.ndarray) -> float:
    # Rebuilt from what leaves the device: noisy sum ~ prototype * max(1, count).
    count = float(release.counts[0])
    return float(release.prototypes[0] @ canary) * max(1.0, count) + count


def _eps_at(tp: int, fp: int, pos: int, neg: int, delta: float) -> float:
    tpr_low, _ = clopper_pearson(tp, pos)
    _, fpr_high = clopper_pearson(fp, neg)
    if tpr_low - delta <= 0 or fpr_high <= 0:
        return 0.0
    return max(0.0, math.log((tpr_low - delta) / fpr_high))


def canary_audit(
    *,
    mechanism: Releaser = release_dp,
    sigma: float = 2.0,
    n: int = 50,
    dim: int = 16,
    runs: int = 20_000,
    delta: float = 1e-5,
    seed: int = 0,
    space: str = "embeddings",
) -> AuditResult:
    """``runs`` releases of one class (sums and counts noised with multiplier ``sigma``),
    half of them with the canary; the claim is the accountant's epsilon for one release.
    ``space``: ``embeddings`` (unit vectors, as the head yields) or ``features`` (norms
    from 0 to 3, and a canary of norm 3, as raw backbone features may have)."""
    if space not in ("embeddings", "features"):
        raise ValueError(f"space must be embeddings or features, got {space!r}")
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, dim))
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    canary = rng.normal(size=dim)
    canary /= np.linalg.norm(canary)
    scale = 1.0
    if space == "features":
        base *= rng.uniform(0.0, 3.0, size=(n, 1))
        scale = 3.0
    with_canary = np.vstack([base, scale * canary[None]])
    params = MechanismParams(sum_sigma=sigma, count_sigma=sigma)
    member = rng.random(runs) < 0.5
    stats = np.empty(runs)
    for i in range(runs):
        z = with_canary if member[i] else base
        stats[i] = _statistic(mechanism(z, np.zeros(len(z), np.int64), 1, params, rng), canary)
    half = runs // 2
    # Choose the threshold on the first half, measure on the second.
    cal_s, cal_m, ev_s, ev_m = stats[:half], member[:half], stats[half:], member[half:]
    candidates = np.quantile(cal_s, np.linspace(0.5, 0.9999, 200))

    def score(t: float, s: np.ndarray, m: np.ndarray) -> float:
        return _eps_at(
            int((s[m] > t).sum()), int((s[~m] > t).sum()), int(m.sum()), int((~m).sum()), delta
        )

    best = max(candidates, key=lambda t: score(t, cal_s, cal_m))
    tp, fp = int((ev_s[ev_m] > best).sum()), int((ev_s[~ev_m] > best).sum())
    pos, neg = int(ev_m.sum()), int((~ev_m).sum())
    claimed = epsilon([release_event(sigma, sigma)], delta=delta)
    return AuditResult(
        epsilon_lower_bound=_eps_at(tp, fp, pos, neg, delta),
        epsilon_claimed=claimed,
        runs=runs,
        threshold=float(best),
        tpr=tp / max(pos, 1),
        fpr=fp / max(neg, 1),
    )


def label_inference_error(true_counts: np.ndarray, released_counts: np.ndarray) -> float:
    """Total variation distance between a client's label distribution and the one an
    observer infers from its released counts (0: the counts give it away exactly)."""
    p = true_counts / max(1, true_counts.sum())
    released = np.maximum(0, released_counts).astype(float)
    q = released / released.sum() if released.sum() > 0 else np.full(len(p), 1 / len(p))
    return float(0.5 * np.abs(p - q).sum())
