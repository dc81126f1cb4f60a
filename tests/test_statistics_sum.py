"""The one running sum and the one stored encoding of class statistics
(closed_form/statistics.py::StatisticsSum, closed_form/encoding.py), and a secure fleet's
running sum kept in them (coordinator/rounds/secure.py::FleetSum), by hand."""

from __future__ import annotations

import base64
import json
import logging

import numpy as np
import pytest

import closed_form as cf
from coordinator.rounds.secure import FleetSum, SecureOutcome
from protocol.codec import pack, unpack
from secagg.fleet import SecureAggregation, flatten, secure_release

# Two devices, two classes, k = 2, rows by hand.
A = cf.device_statistics(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([0, 1]), 2)
B = cf.device_statistics(np.array([[0.6, 0.8]]), np.array([1]), 2)


def test_a_running_sum_adds_and_takes_out_every_field_by_hand() -> None:
    total = cf.StatisticsSum(num_classes=2, dim=2, gram=True, scatter=False)
    total.add(A)
    total.add(B)
    both = total.total()
    assert both.counts.tolist() == [1.0, 2.0]
    assert both.sums.tolist() == [[1.0, 0.0], [0.6, 1.8]]
    assert both.gram is not None
    np.testing.assert_allclose(both.gram, np.array([[1.36, 0.48], [0.48, 1.64]]), atol=1e-15)
    assert both.holders.tolist() == [1, 2] and both.devices == 2
    total.add(B, sign=-1)
    only_a = total.statistics()
    assert only_a is not None and only_a.devices == 1
    np.testing.assert_array_equal(only_a.sums, A.sums)
    assert only_a.holders.tolist() == [1, 1]
    total.add(A, sign=-1)
    assert total.statistics() is None  # no device left
    assert total.total().devices == 0


def test_plus_leaves_both_sums_alone_and_merge_is_the_same_sum() -> None:
    a, b = cf.StatisticsSum.of(A), cf.StatisticsSum.of(B)
    both = a.plus(b).total()
    assert a.devices == 1 and b.devices == 1
    merged = cf.merge([A, B])
    for name in ("counts", "sums", "gram", "holders"):
        np.testing.assert_array_equal(getattr(both, name), getattr(merged, name))


def test_a_running_sum_refuses_another_shape_or_kind() -> None:
    total = cf.StatisticsSum.like(A)
    with pytest.raises(ValueError, match="3 classes x dim 2"):
        total.add(cf.Statistics.empty(num_classes=3, dim=2))
    with pytest.raises(ValueError, match="gram"):
        total.add(cf.Statistics.empty(num_classes=2, dim=2, gram=False))
    fedcof = cf.StatisticsSum(num_classes=2, dim=2, gram=False, scatter=True)
    with pytest.raises(ValueError, match="gram"):
        fedcof.add(A)
    assert total.devices == 0 and fedcof.devices == 0


@pytest.mark.parametrize(
    "stats",
    [
        cf.merge([A, B]),
        cf.merge(
            [
                cf.means_statistics([2.0, 0.0], [[0.5, 0.5], [9.0, 9.0]]),
                cf.means_statistics([1.0, 3.0], [[0.0, 1.0], [1.0, 0.0]]),
            ]
        ),
    ],
    ids=["lda", "fedcof"],
)
def test_the_encoding_round_trips_through_msgpack_to_the_bit(stats: cf.Statistics) -> None:
    fields = cf.statistics_fields(stats)
    back = cf.statistics_from(unpack(pack(fields)), num_classes=2, dim=2)
    for name in ("counts", "sums", "gram", "scatter", "holders"):
        mine, theirs = getattr(stats, name), getattr(back, name)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine.tobytes() == theirs.tobytes()
    assert back.devices == stats.devices


def test_the_encodings_layout_by_hand() -> None:
    fields = cf.statistics_fields(A)
    assert np.frombuffer(fields["gram"], "<f8").tolist() == [1.0, 0.0, 1.0]  # upper triangle
    assert np.frombuffer(fields["holders"], "<i8").tolist() == [1, 1]
    assert fields["scatter"] is None and fields["devices"] == 1


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"counts": b"\0" * 8}, "counts must be 16 bytes"),
        ({"gram": None}, "a second moment or a scatter"),
        ({"devices": -1}, "devices must be an integer"),
        ({"devices": True}, "devices must be an integer"),
        ({"holders": np.array([2, 0], "<i8").tobytes()}, "holders must lie"),
        ({"sums": np.array([np.nan, 0, 0, 0], "<f8").tobytes()}, "finite"),
    ],
)
def test_the_encoding_refuses_what_is_not_statistics_of_the_fleet(change: dict, why: str) -> None:
    fields = {**cf.statistics_fields(A), **change}
    with pytest.raises(ValueError, match=why):
        cf.statistics_from(fields, num_classes=2, dim=2)
    with pytest.raises(ValueError, match="must be a map"):
        cf.statistics_from({**fields, "extra": 1}, num_classes=2, dim=2)


RELEASE = secure_release(
    SecureAggregation(threshold=2, colluding=0, dataset_size=10), k=2, classes=2, gram=True
)


def test_a_secure_fleets_sum_adds_rounds_and_holds_a_class_by_its_count() -> None:
    first = SecureOutcome(round=0, total=flatten(cf.merge([A, B]), gram=True), survivors=2)
    again = SecureOutcome(round=1, total=flatten(B, gram=True), survivors=1)
    kept = FleetSum.empty(RELEASE).plus(first, RELEASE).plus(again, RELEASE)
    kept = kept.plus(SecureOutcome(round=2, total=None, why="too few"), RELEASE)
    assert kept.devices == 3
    assert kept.stats.counts.tolist() == [1.0, 3.0]
    # Class 1 was in both rounds' sums: held by count, not by how many rounds held it.
    assert kept.stats.holders.tolist() == [1, 1]
    back = FleetSum.load(kept.to_meta(), release=RELEASE)
    assert flatten(back.stats, gram=True).tobytes() == flatten(kept.stats, gram=True).tobytes()
    assert back.devices == 3


def test_a_secure_sum_kept_by_an_earlier_version_starts_again_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Issue 51: an earlier version's sum (a flat vector, or statistics alone) records no
    # device's round, so no device's view of it can be checked: every device adds all of its
    # statistics again (their own states record no round either), into an empty sum.
    total = flatten(cf.merge([A, B]), gram=True)
    flat = json.dumps({"devices": 2, "total": base64.b64encode(total.tobytes()).decode()})
    current = json.loads(FleetSum.empty(RELEASE).plus(
        SecureOutcome(round=0, total=total, survivors=2, contributors=("a", "b")), RELEASE
    ).to_meta())  # fmt: skip
    assert current["held"] == {"a": 0, "b": 0} and current["since"] == 0
    statistics_alone = json.dumps({"v": 2, "statistics": current["statistics"]})
    for legacy, version in ((flat, 1), (statistics_alone, 2)):
        kept = FleetSum.load(legacy, release=RELEASE)
        assert kept.devices == 0 and kept.held == {} and kept.since == 0
        assert f"version {version} predates the record of whose inputs it holds" in caplog.text


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"v": 9, "statistics": ""}),
        json.dumps({"devices": 2, "total": base64.b64encode(b"\0" * 8).decode()}),
        FleetSum.empty(
            secure_release(
                SecureAggregation(threshold=2, colluding=0, dataset_size=10),
                k=3,
                classes=2,
                gram=True,
            )
        ).to_meta(),
    ],
    ids=["unreadable", "unknown-version", "short-vector", "other-k"],
)
def test_a_stored_secure_sum_that_is_not_this_fleets_is_left_out_and_said(
    text: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="coordinator.rounds.secure"):
        kept = FleetSum.load(text, release=RELEASE)
    assert kept.devices == 0 and not kept.stats.counts.any()
    assert "secure sum is left out" in caplog.text
