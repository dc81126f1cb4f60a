"""The empirical privacy audits: Clopper-Pearson by hand, the canary audit that holds for
the formal releases and fails for a broken one, and label inference from the counts."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.privacy.mechanisms import MechanismParams, release_dp, release_none
from fleet.report.privacy_audit import (
    canary_audit,
    clopper_pearson,
    label_inference_error,
    release_broken,
)


def test_clopper_pearson_by_hand() -> None:
    low, high = clopper_pearson(0, 100)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 100), rel=1e-9)
    low, high = clopper_pearson(100, 100)
    assert high == 1.0 and low == pytest.approx(0.025 ** (1 / 100), rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("space", ["embeddings", "features"])
def test_the_canary_audit_holds_for_the_release_and_fails_for_a_broken_one(space: str) -> None:
    """Both formal releases: dp (unit embeddings) and dp-features (raw features of norms up
    to 3, clipped by the mechanism)."""
    real = canary_audit(runs=6000, seed=1, space=space)
    broken = canary_audit(runs=6000, seed=1, mechanism=release_broken, space=space)
    assert real.epsilon_claimed == broken.epsilon_claimed
    assert real.epsilon_lower_bound <= real.epsilon_claimed
    assert broken.epsilon_lower_bound > broken.epsilon_claimed  # the audit can fail


def test_label_inference_from_counts_with_and_without_noise() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(60, 8))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    y = np.repeat([0, 1, 2], [40, 15, 5])
    true = np.bincount(y, minlength=4)
    exact = release_none(z, y, 4, MechanismParams(), rng)
    sent = np.zeros(4, np.int64)
    sent[exact.classes] = exact.counts
    assert label_inference_error(true, sent) == 0.0
    noisy = [
        label_inference_error(
            true, release_dp(z, y, 4, MechanismParams(sum_sigma=20.0, count_sigma=20.0), rng).counts
        )
        for _ in range(50)
    ]
    assert np.mean(noisy) > 0.15
