"""Partial sums: by hand on a tiny example, and equal to one aggregation for any split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import aggregate as agg
from coordinator.partial import (
    RAW,
    OverlapError,
    PartialSum,
    global_prototypes,
    merge,
    partial_of,
)
from coordinator.strategies import make_strategy
from protocol import PrototypeUpdate
from tests.coordinator_helpers import DIM, stand_in_update


def two_d(
    client: str, classes: tuple[int, ...], counts: tuple[int, ...], rows: list
) -> PrototypeUpdate:
    return PrototypeUpdate(
        fleet="lab",
        round=1,
        client=client,
        bundle="f" * 64,
        method="fedpcl",
        classes=classes,
        counts=counts,
        prototypes=np.array(rows, dtype=np.float16),
    )


# Two classes in 2-d. A holds class 0 (3 samples, at (1, 0)) and class 1 (1 sample, at
# (0, 1)); B holds class 0 (1 sample, at (0, 1)); C reports class 1 with count 0, so it
# holds nothing and its (1, 1) must not count anywhere.
#   partial {A}:    weighted [[3, 0], [0, 1]]  counts [3, 1]  plain [[1, 0], [0, 1]]  holders [1, 1]
#   partial {B, C}: weighted [[0, 1], [0, 0]]  counts [1, 0]  plain [[0, 1], [0, 0]]  holders [1, 0]
#   merged:         weighted [[3, 1], [0, 1]]  counts [4, 1]  plain [[1, 1], [0, 1]]  holders [2, 1]
#   count:  class 0 (3*(1,0) + 1*(0,1)) / 4 = (0.75, 0.25); class 1 (0, 1)
#   paper:  count / holders: class 0 (0.375, 0.125); class 1 (0, 1)
#   client: class 0 ((1,0) + (0,1)) / 2 = (0.5, 0.5); class 1 (0, 1)
A = two_d("A", (0, 1), (3, 1), [[1, 0], [0, 1]])
B = two_d("B", (0,), (1,), [[0, 1]])
C = two_d("C", (1,), (0,), [[1, 1]])


def test_partial_sums_by_hand() -> None:
    a, bc = partial_of([A], num_classes=2, dim=2), partial_of([B, C], num_classes=2, dim=2)
    np.testing.assert_array_equal(a.weighted, [[3, 0], [0, 1]])
    np.testing.assert_array_equal(bc.weighted, [[0, 1], [0, 0]])
    np.testing.assert_array_equal(bc.plain, [[0, 1], [0, 0]])
    np.testing.assert_array_equal(bc.holders, [1, 0])
    both = merge([a, bc])
    np.testing.assert_array_equal(both.weighted, [[3, 1], [0, 1]])
    np.testing.assert_array_equal(both.counts, [4, 1])
    np.testing.assert_array_equal(both.plain, [[1, 1], [0, 1]])
    np.testing.assert_array_equal(both.holders, [2, 1])
    assert both.clients == {"A", "B", "C"}


@pytest.mark.parametrize(
    ("mean", "expected"),
    [
        ("count", [[0.75, 0.25], [0, 1]]),
        ("paper", [[0.375, 0.125], [0, 1]]),
        ("client", [[0.5, 0.5], [0, 1]]),
    ],
)
def test_global_prototypes_by_hand(mean: str, expected: list) -> None:
    merged = merge(
        [partial_of([A], num_classes=2, dim=2), partial_of([B, C], num_classes=2, dim=2)]
    )
    values, has = global_prototypes(merged, mean=mean)  # type: ignore[arg-type]
    np.testing.assert_array_equal(values, expected)
    np.testing.assert_array_equal(has, [True, True])


def test_a_class_nobody_holds_has_no_global_prototype() -> None:
    values, has = global_prototypes(partial_of([B], num_classes=2, dim=2))
    np.testing.assert_array_equal(has, [True, False])
    np.testing.assert_array_equal(values[1], [0, 0])


def test_merge_refuses_a_client_counted_twice() -> None:
    with pytest.raises(OverlapError, match="B"):
        merge([partial_of([A, B], num_classes=2, dim=2), partial_of([B], num_classes=2, dim=2)])
    with pytest.raises(OverlapError, match="A"):
        partial_of([A, A], num_classes=2, dim=2)


def test_merge_refuses_other_shapes_and_nothing() -> None:
    with pytest.raises(ValueError, match="shapes"):
        merge([PartialSum.empty(num_classes=2, dim=2), PartialSum.empty(num_classes=3, dim=2)])
    with pytest.raises(ValueError, match="at least one"):
        merge([])


def test_a_partial_sum_checks_itself() -> None:
    empty = PartialSum.empty(num_classes=2, dim=2)
    with pytest.raises(ValueError, match="more holders"):
        PartialSum(empty.weighted, empty.counts, empty.plain, np.array([1, 0]), frozenset())
    with pytest.raises(ValueError, match="finite"):
        PartialSum(empty.weighted + np.nan, empty.counts, empty.plain, empty.holders, frozenset())


UPDATES = [stand_in_update(i, 2) for i in range(30)]


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.integers(0, 6), min_size=len(UPDATES), max_size=len(UPDATES)))
def test_any_split_merged_equals_one_aggregation(groups: list[int]) -> None:
    """Group g gets the updates i with groups[i] == g (some groups empty), merged in a
    shuffled order. Float64 sums taken in another grouping round at other points, so the
    results agree to about 1e-16 relative, not bit for bit; 1e-12 leaves room and would
    still catch any real mistake (a lost or doubled update moves a mean by ~1e-2)."""
    split = [[u for u, g in zip(UPDATES, groups, strict=True) if g == k] for k in range(7)]
    parts = [partial_of(s, num_classes=3, dim=DIM) for s in split]
    order = np.random.default_rng(sum(groups)).permutation(len(parts))
    merged = merge(parts[i] for i in order)
    dense = make_strategy("fedpcl", robust=RAW).dense(UPDATES, num_classes=3, dim=DIM)
    for mean, (want, want_has) in [
        ("count", agg.count_weighted_mean(dense.protos, dense.counts)),
        ("paper", agg.count_weighted_mean(dense.protos, dense.counts, weighting="paper")),
        ("client", agg.combine(dense.protos, dense.counts)),
    ]:
        got, has = global_prototypes(merged, mean=mean)  # type: ignore[arg-type]
        np.testing.assert_array_equal(has, want_has)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_merged_partials_give_the_strategies_global_prototypes() -> None:
    halves = [
        partial_of(UPDATES[::2], num_classes=3, dim=DIM),
        partial_of(UPDATES[1::2], num_classes=3, dim=DIM),
    ]
    merged = merge(halves)
    for name, mean in [("fedpcl", "count"), ("fedproto", "client")]:
        want = make_strategy(name, robust=RAW).aggregate(UPDATES, num_classes=3, dim=DIM)
        got, has = global_prototypes(merged, mean=mean)  # type: ignore[arg-type]
        assert tuple(int(c) for c in np.flatnonzero(has)) == want.global_classes
        np.testing.assert_allclose(got[has], want.global_prototypes, rtol=1e-12, atol=1e-15)
    paper = make_strategy("fedpcl", weighting="paper", robust=RAW).aggregate(
        UPDATES, num_classes=3, dim=DIM
    )
    got, has = global_prototypes(merged, mean="paper")
    np.testing.assert_allclose(got[has], paper.global_prototypes, rtol=1e-12, atol=1e-15)
