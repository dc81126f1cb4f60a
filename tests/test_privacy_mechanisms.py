"""The release mechanisms by hand (clipping and its sensitivity included), and the
secret randomness they draw from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_agent.privacy.mechanisms import (
    MechanismParams,
    _sums,
    clip_rows,
    release_dp,
    release_none,
    release_paper,
)
from edge_agent.privacy.randomness import DP_GUARANTEE, REPRODUCIBLE, NoiseSource, guarantee


def unit(rows: list[list[float]]) -> np.ndarray:
    z = np.array(rows, dtype=np.float32)
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def test_release_none_and_paper_by_hand() -> None:
    z = unit([[1, 0], [0, 1], [1, 1]])
    y = np.array([0, 0, 2])
    exact = release_none(z, y, 3, MechanismParams(), np.random.default_rng(0))
    assert exact.classes.tolist() == [0, 2] and exact.counts.tolist() == [2, 1]
    np.testing.assert_allclose(exact.prototypes, [[0.5, 0.5], z[2]], atol=1e-6)

    params = MechanismParams(paper_noise="laplace", paper_scale=0.05, paper_p=0.2)
    noisy = release_paper(z, y, 3, params, np.random.default_rng(7))
    e = np.random.default_rng(7).laplace(0.0, 0.05, size=(2, 2))
    np.testing.assert_allclose(noisy.prototypes, 0.8 * exact.prototypes + e, atol=1e-6)


def test_release_dp_sends_every_class_and_divides_noisy_sums_by_noisy_counts() -> None:
    z = unit([[1, 0], [0, 1], [1, 1]])
    y = np.array([0, 0, 2])
    params = MechanismParams(sum_sigma=2.0, count_sigma=3.0)
    out = release_dp(z, y, 4, params, np.random.default_rng(5))
    rng = np.random.default_rng(5)
    sums = np.array([[1, 1], [0, 0], z[2], [0, 0]], dtype=np.float64)
    noisy_sums = sums + rng.normal(0, 2.0, size=(4, 2))
    noisy_counts = np.array([2.0, 0, 1, 0]) + rng.normal(0, 3.0, size=4)
    assert out.classes.tolist() == [0, 1, 2, 3]  # absent classes too
    np.testing.assert_allclose(
        out.prototypes, noisy_sums / np.maximum(1, noisy_counts)[:, None], rtol=1e-5
    )
    # Sent as drawn (clamped at 0), as floats: no rounding, no size that depends on them.
    np.testing.assert_allclose(out.counts, np.maximum(0.0, noisy_counts))
    assert out.counts.dtype == np.float64


def test_release_dp_clips_a_zero_vector_and_one_of_norm_3_instead_of_refusing() -> None:
    z = np.array([[0.0, 0.0], [3.0, 0.0], [0.6, 0.8], [0.3, 0.4]])
    np.testing.assert_allclose(clip_rows(z), np.array([[0, 0], [1, 0], [0.6, 0.8], [0.3, 0.4]]))
    y = np.array([0, 0, 1, 1])
    out = release_dp(z, y, 2, MechanismParams(sum_sigma=0.5, count_sigma=0.5),
                     np.random.default_rng(9))  # fmt: skip
    rng = np.random.default_rng(9)
    # By hand: class 0 sums 0 + (1, 0); class 1 sums (0.6, 0.8) + (0.3, 0.4).
    sums = np.array([[1.0, 0.0], [0.9, 1.2]]) + rng.normal(0, 0.5, size=(2, 2))
    counts = np.array([2.0, 2.0]) + rng.normal(0, 0.5, size=2)
    np.testing.assert_allclose(out.prototypes, sums / np.maximum(1, counts)[:, None], rtol=1e-5)


def test_the_clipped_sum_has_sensitivity_1_under_add_or_remove() -> None:
    """By hand: removing the norm-3 vector moves its class's sum by exactly 1; and over
    random data sets and removed vectors of any norm, never by more."""
    z = np.array([[0.0, 0.0], [3.0, 0.0], [0.6, 0.8]])
    y = np.array([0, 0, 1])
    whole, _ = _sums(clip_rows(z), y, 2)
    without, _ = _sums(clip_rows(np.delete(z, 1, axis=0)), np.delete(y, 1), 2)
    assert np.linalg.norm(whole - without) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 20))
        x = rng.normal(size=(n, 5)) * rng.uniform(0, 10, size=(n, 1))
        labels = rng.integers(0, 3, size=n)
        drop = int(rng.integers(0, n))
        a, ca = _sums(clip_rows(x), labels, 3)
        b, cb = _sums(clip_rows(np.delete(x, drop, axis=0)), np.delete(labels, drop), 3)
        assert np.linalg.norm(a - b) <= 1.0 + 1e-9
        assert np.abs(ca - cb).sum() == 1.0


def test_mechanism_randomness_is_secret_unless_reproducible_is_asked_for() -> None:
    a, b = NoiseSource.create(), NoiseSource.create()
    assert not a.reproducible
    assert not np.array_equal(a.numpy.normal(size=8), b.numpy.normal(size=8))
    assert not torch.equal(torch.rand(64, generator=a.torch), torch.rand(64, generator=b.torch))
    c, d = NoiseSource.create(5), NoiseSource.create(5)
    assert c.reproducible
    np.testing.assert_array_equal(c.numpy.normal(size=8), d.numpy.normal(size=8))
    assert torch.equal(torch.rand(64, generator=c.torch), torch.rand(64, generator=d.torch))
    assert guarantee(formal=True, reproducible=False) == DP_GUARANTEE
    assert guarantee(formal=True, reproducible=True) == REPRODUCIBLE == "none (reproducible noise)"
    assert guarantee(formal=False, reproducible=False) == "none"
