"""The defences on by default: one compromised device weighs what the median holder
weighs, pulls no harder by the length of its rows, and under FedPCL counts for nothing
where its row points away from its class's consensus (docs/coordinator.md). Every figure
is computed by hand."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from coordinator import aggregate as agg
from coordinator.strategies import RobustOptions, make_strategy
from coordinator.strategies.base import RAW
from tests.test_coordinator_strategies import update


def test_class_medians_are_lower_medians_over_the_holders():
    counts = np.array([[4.0, 0.0, 1.0], [2.0, 5.0, 0.0], [9.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # Class 0 holders 4, 2, 9, 1 -> sorted 1 2 4 9, lower median 2; class 1 one holder: 5;
    # class 2 one holder: 1. Nobody's zeros count.
    np.testing.assert_array_equal(agg.class_medians(counts, counts), [2.0, 5.0, 1.0])
    # A class nobody holds has no cap.
    assert agg.class_medians(np.zeros((2, 1)), np.zeros((2, 1)))[0] == np.inf


def test_a_claimed_count_is_capped_at_the_median_holders():
    counts = np.array([[10.0], [12.0], [8.0], [1e5]])
    # Lower median of 8, 10, 12, 1e5 is 10: the liar counts 10, the honest keep theirs.
    np.testing.assert_array_equal(agg.cap_counts_at_median(counts), [[10.0], [10.0], [8.0], [10.0]])


def test_fedpcl_gives_a_liars_count_the_median_weight():
    honest = [update(f"h{i}", [0], [10], [[1.0, 0.0]]) for i in range(4)]
    liar = update("liar", [0], [1e5], [[0.0, 1.0]])
    raw = make_strategy("fedpcl", robust=RAW).aggregate([*honest, liar], num_classes=1, dim=2)
    assert raw.global_prototypes[0, 1] > 0.99  # counts as sent: the liar's row wins
    # The direction screen would drop the liar's orthogonal row outright (tested below).
    count_cap_only = RobustOptions(median_direction_screen=False)
    result = make_strategy("fedpcl", robust=count_cap_only).aggregate(
        [*honest, liar], num_classes=1, dim=2
    )
    # Capped at 10: (4 * 10 * [1, 0] + 10 * [0, 1]) / 50 = [0.8, 0.2].
    np.testing.assert_allclose(result.global_prototypes, [[0.8, 0.2]], rtol=1e-6)


def test_rows_no_longer_than_one_are_left_bit_for_bit():
    rng = np.random.default_rng(3)
    ups = []
    for i in range(5):
        rows = rng.normal(size=(2, 4))
        rows *= rng.uniform(0.2, 1.0, size=(2, 1)) / np.linalg.norm(rows, axis=1, keepdims=True)
        ups.append(update(f"c{i}", [0, 1], [7, 7], rows))  # equal counts: no cap bites
    for name in ("fedpcl", "fedproto", "feddbp"):
        params: dict[str, Any] = {"top_k": 2} if name == "feddbp" else {}
        if name == "feddbp":
            ups = [
                update(u.client, u.classes, u.counts, u.prototypes, fisher=np.ones((2, 4)))
                for u in ups
            ]
        plain = make_strategy(name, robust=RAW, **params).aggregate(ups, num_classes=2, dim=4)
        # Random directions: FedPCL's direction screen would drop some (tested below).
        clip = RobustOptions(median_direction_screen=False)
        default = make_strategy(name, robust=clip, **params).aggregate(ups, num_classes=2, dim=4)
        assert np.array_equal(plain.global_prototypes, default.global_prototypes)


def test_a_noised_liars_row_is_clipped_to_the_median_norm():
    # Under noise every honest row is longer than 1 (here 3); the liar's 300 is cut to 3.
    honest = [update(f"h{i}", [0], [5], [[3.0, 0.0]]) for i in range(4)]
    liar = update("liar", [0], [5], [[0.0, 300.0]])
    result = make_strategy("fedproto").aggregate([*honest, liar], num_classes=1, dim=2)
    # (4 * [3, 0] + [0, 3]) / 5 = [2.4, 0.6].
    np.testing.assert_allclose(result.global_prototypes, [[2.4, 0.6]], rtol=1e-6)


def test_fedavg_caps_weights_and_clips_arrays_at_the_median_device():
    a = update("a", [0], [1], [[0.0]], w=[[0.0, 4.0]])
    b = update("b", [0], [3], [[0.0]], w=[[4.0, 0.0]])
    liar = update("liar", [0], [1e5], [[0.0]], w=[[0.0, -400.0]])
    result = make_strategy("fedavg").aggregate([a, b, liar], num_classes=1, dim=1)
    # Totals 1, 3, 1e5: lower median 3, so weights 1, 3, 3 (shares 1/7, 3/7, 3/7); norms
    # 4, 4, 400: lower median 4, so the liar's array becomes [0, -4].
    # 1/7 [0, 4] + 3/7 [4, 0] + 3/7 [0, -4] = [12/7, -8/7].
    np.testing.assert_allclose(result.extras["w"], [[12 / 7, -8 / 7]], rtol=1e-6)


@pytest.mark.parametrize(
    ("n", "trim", "want"), [(2, 0.1, 0), (3, 0.1, 1), (10, 0.1, 1), (20, 0.1, 2), (5, 0.0, 0)]
)
def test_the_trimmed_mean_trims_one_whenever_it_can(n, trim, want):
    assert agg.trimmed_per_side(n, trim) == want


def test_a_trimmed_mean_of_three_drops_the_outlier():
    ups = [update("b", [0], [1], [[1.0]]), update("c", [0], [1], [[0.9]])]
    liar = update("liar", [0], [1], [[-1.0]])
    robust = RobustOptions(rule="trimmed_mean", trim=0.1)
    result = make_strategy("fedproto", robust=robust).aggregate([*ups, liar], num_classes=1, dim=1)
    # Three holders: 1.0, 0.9, -1.0 -> one dropped at each end -> 0.9 (the mean: 0.3).
    np.testing.assert_allclose(result.global_prototypes, [[0.9]], rtol=1e-6)


# Class 0 of four holders, equal counts. Coordinate-wise median: x of 0, 0.6, 1, 1 is 0.8,
# y of -1, 0, 0, 0.8 is 0; so the centre points along [1, 0] and the cosines are 1, 1, 0.6
# and 0. Their lower median is 0.6, half of it 0.3: only the liar's 0 is below.
SCREEN_ROWS = [[1.0, 0.0], [1.0, 0.0], [0.6, 0.8], [0.0, -1.0]]


def screen_updates() -> list:
    names = ["h0", "h1", "h2", "liar"]
    return [update(n, [0], [10], [row]) for n, row in zip(names, SCREEN_ROWS, strict=True)]


def test_fedpcl_counts_a_row_against_the_consensus_for_nothing():
    result = make_strategy("fedpcl").aggregate(screen_updates(), num_classes=1, dim=2)
    # The three honest rows alone: ([1, 0] + [1, 0] + [0.6, 0.8]) / 3.
    want = [[2.6 / 3, 0.8 / 3]]
    np.testing.assert_allclose(result.global_prototypes, want, rtol=1e-6)
    # The liar's row is relayed as the global row, as a class it had not reported would
    # be (Eq. 7); the honest rows are relayed as sent.
    np.testing.assert_allclose(result.local_sets["liar"], want, rtol=1e-6)
    np.testing.assert_allclose(result.local_sets["h2"], [[0.6, 0.8]], rtol=1e-6)


def test_the_direction_screen_can_be_switched_off():
    robust = RobustOptions(median_direction_screen=False)
    result = make_strategy("fedpcl", robust=robust).aggregate(
        screen_updates(), num_classes=1, dim=2
    )
    # All four at equal weight: ([1, 0] + [1, 0] + [0.6, 0.8] + [0, -1]) / 4.
    np.testing.assert_allclose(result.global_prototypes, [[0.65, -0.05]], rtol=1e-6)
    np.testing.assert_allclose(result.local_sets["liar"], [[0.0, -1.0]])
    assert not RAW.median_direction_screen


def test_the_direction_screen_is_on_by_default():
    assert RobustOptions().median_direction_screen
