"""What one device's closed-form statistics can be (coordinator/statistics_checks.py), on
hand-computed releases of three rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from closed_form import upper_triangle
from coordinator.closed_form_settings import ClosedFormSettings
from coordinator.statistics_checks import StatisticsBounds, statistics_problem
from protocol import PrivacyMeta
from protocol.methods import COUNTS as DRAWN
from tests.test_coordinator_closed_form import _config, devices, update_of

# Rows (1, 0) and (0, 1) of class 0, (1, 0) of class 1: N = 3, every row of norm 1.
COUNTS = np.array([2.0, 1.0])
SUMS = np.array([[1.0, 1.0], [1.0, 0.0]])
GRAM = np.array([[2.0, 0.0], [0.0, 1.0]])  # tr = 3 = N; W = [[.5, -.5], [-.5, .5]], PSD
EXACT = StatisticsBounds(max_samples=10, unit_rows=True)


def problem(counts=COUNTS, sums=SUMS, gram=GRAM, bounds=EXACT):
    tri = None if gram is None else upper_triangle(np.asarray(gram, dtype=np.float64))
    return statistics_problem(counts, sums, tri, bounds)


def test_a_real_devices_release_passes():
    assert problem() is None
    assert problem(gram=None) is None  # FedCOF sends no second moment


@pytest.mark.parametrize(
    ("counts", "why"),
    [
        ([2.5, 1.0], "fractional_count"),
        ([4.0, -1.0], "negative_count"),  # the total is still 3
        ([8.0, 3.0], "samples_above_max"),  # 11 samples, above max_samples = 10
    ],
)
def test_counts_are_whole_non_negative_and_within_the_device_bound(counts, why):
    assert problem(counts=np.array(counts)) == why


def test_a_class_sum_longer_than_its_count_is_refused():
    assert problem(sums=SUMS * 2.0) == "implausible_statistics"


def test_a_second_moment_whose_trace_is_not_the_sample_count_is_refused():
    assert problem(gram=GRAM * 2.0) == "implausible_statistics"  # tr 6 > N = 3
    # Rows of norm 1 give tr(G) = N exactly; projected rows (here halved) may be shorter.
    assert problem(sums=SUMS / 2, gram=GRAM / 4) == "implausible_statistics"
    projected = StatisticsBounds(max_samples=10, unit_rows=False)
    assert problem(sums=SUMS / 2, gram=GRAM / 4, bounds=projected) is None


def test_a_second_moment_with_negative_within_class_spread_is_refused():
    # tr(G) = 3 = N, but W = G - sum s s^T / n has eigenvalue 2.5 - sqrt(0.25 + 25) < 0.
    indefinite = np.array([[2.0, 5.0], [5.0, 1.0]])
    assert problem(gram=indefinite) == "implausible_statistics"
    # The class means alone, no spread (W = 0): tr(G) = 2 < 3 for rows of norm 1.
    no_spread = np.outer(SUMS[0], SUMS[0]) / 2 + np.outer(SUMS[1], SUMS[1])
    assert problem(gram=no_spread) == "implausible_statistics"


def test_a_noisy_release_is_held_to_its_bounds_plus_six_sigma_of_noise():
    noisy = StatisticsBounds(max_samples=10, sigma=1.0)
    assert problem(counts=np.array([2.4, -5.9]), bounds=noisy) is None  # within 6 sigma
    assert problem(counts=np.array([2.0, -6.1]), bounds=noisy) == "negative_count"
    # Total 10 + 6 * sqrt(2) = 18.49 at most.
    assert problem(counts=np.array([9.0, 9.4]), bounds=noisy) is None
    assert problem(counts=np.array([9.0, 9.6]), bounds=noisy) == "samples_above_max"
    # ||s_c|| <= count + sigma (sqrt(k) + 12): 2 + 13.41 for class 0.
    assert problem(sums=np.array([[15.0, 0.0], [1.0, 0.0]]), bounds=noisy) is None
    assert problem(sums=np.array([[16.0, 0.0], [1.0, 0.0]]), bounds=noisy) == (
        "implausible_statistics"
    )
    # Smallest eigenvalue at least -sigma (2 sqrt(2) + 12) = -14.83.
    assert problem(gram=np.diag([2.0, -14.0]), bounds=noisy) is None
    assert problem(gram=np.diag([2.0, -15.0]), bounds=noisy) == "implausible_statistics"


def test_honest_noisy_releases_are_refused_less_than_once_in_ten_thousand():
    # The stated rate is below 1e-6 a release; 10,000 draws at k = 16 find none refused.
    rng = np.random.default_rng(0)
    k, c, sigma = 16, 10, 8.66
    bounds = StatisticsBounds(max_samples=1000, sigma=sigma)
    x = rng.normal(size=(120, k))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y = np.arange(120) % c
    counts = np.bincount(y, minlength=c).astype(float)
    sums = np.zeros((c, k))
    np.add.at(sums, y, x)
    tri = upper_triangle(x.T @ x)
    refused = 0
    for _ in range(10_000):
        got = statistics_problem(
            counts + rng.normal(0, sigma, c), sums + rng.normal(0, sigma, sums.shape),
            tri + rng.normal(0, sigma, tri.shape), bounds,
        )  # fmt: skip
        refused += got is not None
    assert refused == 0


def test_the_fleet_not_the_update_says_which_release_is_checked(tmp_path):
    checks = _config(tmp_path).admission_checks()  # release = "exact", the default
    x, y = devices(9, count=1)[0]
    good = update_of(x, y, "d0", method="lda")
    assert checks.check(good) is None
    claimed = PrivacyMeta(mechanism="dp-features", epsilon=1.0, delta=1e-5, guarantee="dp")
    assert checks.check(dataclasses.replace(good, privacy=claimed)) == "wrong_release"
    # The summed field is the one checked: counts as drawn ten times the counts field.
    drawn = {**good.extras, DRAWN: np.asarray(good.extras[DRAWN]) * 10}
    assert checks.check(dataclasses.replace(good, extras=drawn)) == "implausible_statistics"
    noisy_fleet = dataclasses.replace(
        _config(tmp_path), closed_form=ClosedFormSettings(release="noisy")
    ).admission_checks()
    assert noisy_fleet.check(good) == "wrong_release"
