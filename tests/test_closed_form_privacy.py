"""The DP release of class statistics: its sensitivity, the Gaussian mechanism and the
post-processing of a noisy sum."""

import math

import numpy as np
import pytest

from closed_form.privacy import (
    SENSITIVITY,
    denoise,
    noised,
    release_delta,
    sensitivity_bound,
)
from closed_form.statistics import Statistics, clip_rows, device_statistics
from closed_form.triangles import triangle_size, upper_triangle


def test_sensitivity_is_reached_by_a_unit_basis_vector() -> None:
    assert sensitivity_bound() == SENSITIVITY == math.sqrt(3.0)
    delta = release_delta(np.eye(6)[0], 2, 4)
    assert delta.shape == (triangle_size(6) + 4 * 6 + 4,)
    assert np.linalg.norm(delta) == pytest.approx(math.sqrt(3.0), abs=1e-15)


def test_sensitivity_bound_holds_for_clipped_random_rows() -> None:
    rng = np.random.default_rng(8)
    k, classes = 10, 5
    directions = rng.normal(size=(200, k))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    raw = directions * rng.uniform(0.0, 3.0, size=(200, 1))
    raw[:20] = directions[:20]  # exactly norm 1
    raw[20:30] = np.eye(k)  # axis-aligned unit rows: the only ones where the bound is tight
    rows = clip_rows(raw)
    norms = np.array(
        [np.linalg.norm(release_delta(r, int(rng.integers(classes)), classes)) for r in rows]
    )
    assert norms.max() <= SENSITIVITY + 1e-12
    np.testing.assert_allclose(norms[20:30], SENSITIVITY, rtol=1e-15)
    # the released triangle of x x^T has squared norm (||x||^4 + sum x_i^4) / 2, so a generic
    # unit row stays below the bound; a delta of the wrong layout would miss this identity
    sq = np.sum(rows**2, axis=1)
    want = np.sqrt((sq**2 + np.sum(rows**4, axis=1)) / 2 + sq + 1)
    np.testing.assert_allclose(norms, want, rtol=1e-12)


def test_noised_adds_sigma_per_released_coordinate_and_keeps_gram_symmetric() -> None:
    rng = np.random.default_rng(9)
    k, classes, sigma = 40, 10, 0.7
    stats = device_statistics(
        clip_rows(rng.normal(size=(100, k))), rng.integers(0, classes, 100), classes
    )
    noisy = noised(stats, sigma=sigma, rng=rng)
    assert noisy.gram is not None and stats.gram is not None
    np.testing.assert_array_equal(noisy.gram, noisy.gram.T)
    tri = upper_triangle(noisy.gram - stats.gram)
    off_diagonal = (noisy.gram - stats.gram)[np.triu_indices(k, 1)]
    sums = (noisy.sums - stats.sums).ravel()
    every = np.concatenate([tri, sums, noisy.counts - stats.counts])
    # each group's standard deviation within ~5 standard errors of sigma; the mirrored half
    # must not be a second draw (that would be sigma * sqrt(2) off the diagonal)
    for group, tolerance in ((off_diagonal, 0.15), (sums, 0.2), (every, 0.1)):
        assert abs(group.std() / sigma - 1.0) < tolerance
        assert abs(group.mean()) < 5 * sigma / math.sqrt(group.size)
    assert noisy.holders.tolist() == stats.holders.tolist()
    assert noisy.devices == stats.devices


def test_noised_refuses_a_release_without_gram() -> None:
    with pytest.raises(ValueError, match="gram"):
        noised(
            Statistics.empty(num_classes=2, dim=2, gram=False),
            sigma=1.0,
            rng=np.random.default_rng(0),
        )


def test_denoise_makes_gram_psd_and_drops_classes_below_one() -> None:
    rng = np.random.default_rng(10)
    stats = device_statistics(clip_rows(rng.normal(size=(8, 6))), rng.integers(0, 3, 8), 3)
    noisy = noised(stats, sigma=5.0, rng=rng)
    assert noisy.gram is not None
    assert np.linalg.eigvalsh(noisy.gram).min() < 0  # the noise did break PSD
    clean = denoise(noisy)
    assert clean.gram is not None
    np.testing.assert_array_equal(clean.gram, clean.gram.T)
    assert np.linalg.eigvalsh(clean.gram).min() >= -1e-10
    # the nearest PSD matrix: negative eigenvalues to 0, the others kept
    np.testing.assert_allclose(
        np.linalg.eigvalsh(clean.gram), np.maximum(np.linalg.eigvalsh(noisy.gram), 0.0), atol=1e-10
    )
    assert (clean.counts >= 0).all()

    by_hand = Statistics(
        counts=np.array([-2.0, 0.5, 3.0]),
        sums=np.ones((3, 2)),
        gram=np.eye(2),
        holders=np.array([1, 1, 1]),
        scatter=None,
        devices=2,
    )
    clean = denoise(by_hand)
    assert clean.counts.tolist() == [0.0, 0.0, 3.0]
    assert clean.sums.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert clean.holders.tolist() == [1, 1, 1] and clean.devices == 2


def test_denoise_leaves_exact_statistics_alone() -> None:
    rng = np.random.default_rng(11)
    stats = device_statistics(clip_rows(rng.normal(size=(50, 6))), rng.integers(0, 3, 50), 3)
    clean = denoise(stats)
    assert clean.gram is not None and stats.gram is not None
    np.testing.assert_allclose(clean.gram, stats.gram, atol=1e-12)
    np.testing.assert_array_equal(clean.counts, stats.counts)
