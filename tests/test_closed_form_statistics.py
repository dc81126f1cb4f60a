"""Class statistics: the released triangle of a Gram matrix, clipping, one device's
counts, sums and Gram matrix by hand, and merge, the exact sum over devices."""

import numpy as np
import pytest

from closed_form.statistics import (
    Statistics,
    clip_rows,
    device_statistics,
    means_statistics,
    merge,
)
from closed_form.triangles import (
    dim_of_triangle,
    from_upper_triangle,
    triangle_size,
    upper_triangle,
)

# --------------------------------------------------------------------------- triangles


def test_upper_triangle_is_row_major_and_round_trips() -> None:
    g = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]])
    assert upper_triangle(g).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    rng = np.random.default_rng(0)
    for k in range(7):
        a = rng.normal(size=(k, k))
        sym = a + a.T
        assert triangle_size(k) == k * (k + 1) // 2 == upper_triangle(sym).shape[0]
        assert dim_of_triangle(triangle_size(k)) == k
        np.testing.assert_array_equal(from_upper_triangle(upper_triangle(sym)), sym)


@pytest.mark.parametrize("n", [2, 4, 7, 11, -1])
def test_dim_of_triangle_rejects_non_triangular_lengths(n: int) -> None:
    with pytest.raises(ValueError):
        dim_of_triangle(n)


def test_from_upper_triangle_rejects_a_length_that_is_no_triangle() -> None:
    with pytest.raises(ValueError, match="not a triangular number"):
        from_upper_triangle(np.zeros(7))


# --------------------------------------------------------------------------- clipping


def test_clip_rows_scales_long_rows_down_and_leaves_the_rest() -> None:
    x = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [0.0, -2.0]])
    got = clip_rows(x)
    np.testing.assert_allclose(got, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0], [0.0, -1.0]])
    assert got.dtype == np.float64
    np.testing.assert_allclose(clip_rows(x, 0.25)[1], [0.15, 0.2])


def test_clip_rows_rejects_a_non_positive_bound() -> None:
    with pytest.raises(ValueError, match="bound"):
        clip_rows(np.ones((2, 2)), 0.0)


# --------------------------------------------------------------------------- statistics


def test_device_statistics_by_hand() -> None:
    x = np.array([[1.0, 0.0], [0.0, 0.5], [0.5, 0.5]])
    stats = device_statistics(x, np.array([0, 2, 0]), 3)
    assert stats.counts.tolist() == [2.0, 0.0, 1.0]
    assert stats.sums.tolist() == [[1.5, 0.5], [0.0, 0.0], [0.0, 0.5]]
    # G = e1 e1^T + (0, .5)(0, .5)^T + (.5, .5)(.5, .5)^T
    assert stats.gram is not None
    assert stats.gram.tolist() == [[1.25, 0.25], [0.25, 0.5]]
    assert stats.holders.tolist() == [1, 0, 1]
    assert stats.holders.dtype == np.int64
    assert (stats.devices, stats.num_classes, stats.dim) == (1, 3, 2)
    assert stats.scatter is None
    assert device_statistics(x, np.array([0, 2, 0]), 3, gram=False).gram is None


def test_device_statistics_rejects_labels_out_of_range() -> None:
    with pytest.raises(ValueError, match="labels"):
        device_statistics(np.zeros((2, 3)), np.array([0, 3]), 3)


def test_means_statistics_by_hand_ignores_means_of_absent_classes() -> None:
    stats = means_statistics(np.array([2.0, 0.0]), np.array([[0.5, 0.25], [np.nan, np.nan]]))
    assert stats.sums.tolist() == [[1.0, 0.5], [0.0, 0.0]]
    assert stats.gram is None
    assert stats.holders.tolist() == [1, 0]
    assert stats.scatter is not None
    # 2 * (0.5, 0.25)(0.5, 0.25)^T
    assert stats.scatter[0].tolist() == [[0.5, 0.25], [0.25, 0.125]]
    assert not stats.scatter[1].any()


def _valid_fields() -> dict[str, object]:
    return {
        "counts": np.array([1.0, 0.0]),
        "sums": np.zeros((2, 3)),
        "gram": np.eye(3),
        "holders": np.array([1, 0]),
        "scatter": None,
        "devices": 1,
    }


@pytest.mark.parametrize(
    "change, message",
    [
        ({"counts": np.zeros(3)}, "counts has shape"),
        ({"sums": np.zeros(3)}, "sums must have shape"),
        ({"gram": np.eye(2)}, "gram has shape"),
        ({"gram": np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])}, "symmetric"),
        ({"sums": np.full((2, 3), np.inf)}, "non-finite"),
        ({"holders": np.array([-1, 0])}, "holders must lie"),
        ({"holders": np.array([2, 0])}, "holders must lie"),
        ({"holders": np.array([1.0, 0.0])}, "holders must be integers"),
        ({"scatter": np.zeros((2, 3, 2))}, "scatter has shape"),
        ({"devices": -1}, "devices must be >= 0"),
        ({"devices": True}, "devices must be an integer"),
    ],
)
def test_statistics_refuse_malformed_fields(change: dict[str, object], message: str) -> None:
    fields = _valid_fields() | change
    with pytest.raises(ValueError, match=message):
        Statistics(**fields)  # type: ignore[arg-type]


def test_statistics_arrays_are_read_only_copies() -> None:
    counts = np.array([1.0, 0.0])
    stats = Statistics(**(_valid_fields() | {"counts": counts}))  # type: ignore[arg-type]
    counts[0] = 5.0
    assert stats.counts[0] == 1.0
    with pytest.raises(ValueError):
        stats.counts[0] = 2.0


def test_merge_refuses_empty_and_mismatched_parts() -> None:
    base = Statistics.empty(num_classes=3, dim=4)
    with pytest.raises(ValueError, match="at least one"):
        merge([])
    with pytest.raises(ValueError, match="classes x dim"):
        merge([base, Statistics.empty(num_classes=3, dim=5)])
    with pytest.raises(ValueError, match="classes x dim"):
        merge([base, Statistics.empty(num_classes=2, dim=4)])
    with pytest.raises(ValueError, match="gram"):
        merge([base, Statistics.empty(num_classes=3, dim=4, gram=False)])
    with pytest.raises(ValueError, match="scatter"):
        merge([base, Statistics.empty(num_classes=3, dim=4, scatter=True)])


def test_merge_adds_every_field_and_empty_is_its_identity() -> None:
    rng = np.random.default_rng(1)
    a = device_statistics(clip_rows(rng.normal(size=(6, 3))), rng.integers(0, 2, 6), 2)
    b = device_statistics(clip_rows(rng.normal(size=(4, 3))), np.array([1, 1, 1, 1]), 2)
    both = merge([Statistics.empty(num_classes=2, dim=3), a, b])
    assert both.devices == 2
    assert both.holders.tolist() == (a.holders + b.holders).tolist()
    np.testing.assert_array_equal(both.counts, a.counts + b.counts)
    np.testing.assert_array_equal(both.sums, a.sums + b.sums)
    assert both.gram is not None and a.gram is not None and b.gram is not None
    np.testing.assert_array_equal(both.gram, a.gram + b.gram)
