"""Partial sums: by hand on a tiny example, and equal to one aggregation for any split; the
closed-form statistics' partials likewise, and their wire form."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import closed_form as cf
from coordinator import aggregate as agg
from coordinator.strategies import make_strategy
from coordinator.strategies.closed_form import ClosedForm, fleet_statistics
from coordinator.tier.partial import (
    RAW,
    OverlapError,
    PartialSum,
    global_prototypes,
    merge,
    partial_of,
)
from coordinator.tier.partial_statistics import StatisticsPart, merge_parts, part_of, replaced
from coordinator.tier.partial_wire import CollectRequest, Copy, PartialMessage
from edge_agent.closed_form import StatisticsRelease
from protocol import PrototypeUpdate
from protocol.codec import pack, unpack
from protocol.errors import MalformedPayload
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


# -- closed-form statistics (coordinator/tier/partial_statistics.py, their wire form) ----------------


def release(client: str, x: list, y: list, *, method: str = "lda", round_: int = 1):
    """A device's statistics update of rows ``x`` (2-d) and labels ``y`` over 2 classes."""
    stats = cf.device_statistics(np.array(x, dtype=np.float64), np.array(y), 2,
                                 gram=method != "fedcof")  # fmt: skip
    return StatisticsRelease.of(stats).update(
        fleet="lab", round_=round_, client=client, bundle="f" * 64, method=method
    )


# D: (1, 0) of class 0 and (0, 1) of class 1; E: (0.6, 0.8) twice, of class 0; E2 (E's
# later data): (0, 1) of class 1. F sends no rows (its statistics were sent before).
#   {D}:    counts [1, 1]  sums [[1, 0], [0, 1]]      gram [[1, 0], [0, 1]]  holders [1, 1]
#   {E}:    counts [2, 0]  sums [[1.2, 1.6], [0, 0]]  gram 2 (0.6, 0.8)(0.6, 0.8)^T
#                                                          = [[0.72, 0.96], [0.96, 1.28]]
#   {D, E}: counts [3, 1]  sums [[2.2, 1.6], [0, 1]]  gram [[1.72, 0.96], [0.96, 2.28]]
#           holders [2, 1], devices 2
#   E2 replaces E: counts [1, 2]  sums [[1, 0], [0, 2]]  gram [[1, 0], [0, 2]]  holders [1, 2]
D = release("D", [[1, 0], [0, 1]], [0, 1])
E = release("E", [[0.6, 0.8], [0.6, 0.8]], [0, 0])
E2 = release("E", [[0, 1]], [1], round_=2)
F = StatisticsRelease.nothing(2).update(fleet="lab", round_=1, client="F", bundle="f" * 64,
                                        method="lda")  # fmt: skip


def _f(values: list) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def test_statistics_parts_by_hand() -> None:
    d = part_of([D, F], num_classes=2, dim=2, gram=True)
    assert d.clients == {"D"}  # F carries none
    e = part_of([E], num_classes=2, dim=2, gram=True)
    assert e.stats.gram is not None
    np.testing.assert_allclose(e.stats.gram, _f([[0.72, 0.96], [0.96, 1.28]]), rtol=1e-15)
    both = merge_parts([e, d])
    assert both.clients == {"D", "E"} and both.stats.devices == 2
    assert both.stats.gram is not None
    np.testing.assert_array_equal(both.stats.counts, [3, 1])
    np.testing.assert_allclose(both.stats.sums, _f([[2.2, 1.6], [0, 1]]), rtol=1e-15)
    np.testing.assert_allclose(both.stats.gram, _f([[1.72, 0.96], [0.96, 2.28]]), rtol=1e-15)
    np.testing.assert_array_equal(both.stats.holders, [2, 1])
    later = part_of([E2], num_classes=2, dim=2, gram=True)
    now = replaced(both.stats, later.stats, e.stats)
    assert now.devices == 2 and now.gram is not None
    np.testing.assert_array_equal(now.counts, [1, 2])
    np.testing.assert_allclose(now.sums, _f([[1, 0], [0, 2]]), atol=1e-15)
    np.testing.assert_allclose(now.gram, _f([[1, 0], [0, 2]]), atol=1e-15)
    np.testing.assert_array_equal(now.holders, [1, 2])
    gone = replaced(now, StatisticsPart.empty(num_classes=2, dim=2, gram=True).stats, now)
    assert gone.devices == 0 and gone.gram is not None  # the empty statistics, not None


def test_fedcof_parts_sum_the_scatter_of_the_means_by_hand() -> None:
    # E's class-0 mean (0.6, 0.8) over 2 rows: 2 (0.6, 0.8)(0.6, 0.8)^T; D's means are its rows.
    d = part_of([release("D", [[1, 0], [0, 1]], [0, 1], method="fedcof")], num_classes=2,
                dim=2, gram=False)  # fmt: skip
    e = part_of([release("E", [[0.6, 0.8], [0.6, 0.8]], [0, 0], method="fedcof")],
                num_classes=2, dim=2, gram=False)  # fmt: skip
    both = merge_parts([d, e])
    assert both.stats.gram is None and both.stats.scatter is not None
    want = _f([[[1.72, 0.96], [0.96, 1.28]], [[0, 0], [0, 1]]])
    np.testing.assert_allclose(both.stats.scatter, want, rtol=1e-15)
    np.testing.assert_array_equal(both.stats.holders, [2, 1])


def test_statistics_parts_refuse_a_client_twice_and_another_kind() -> None:
    with pytest.raises(OverlapError, match="E"):
        merge_parts([part_of([E], num_classes=2, dim=2, gram=True),
                     part_of([E2], num_classes=2, dim=2, gram=True)])  # fmt: skip
    with pytest.raises(OverlapError, match="E"):
        part_of([E, E2], num_classes=2, dim=2, gram=True)
    with pytest.raises(ValueError, match="disagree on carrying a gram"):
        merge_parts([StatisticsPart.empty(num_classes=2, dim=2, gram=True),
                     StatisticsPart.empty(num_classes=2, dim=2, gram=False)])  # fmt: skip
    with pytest.raises(ValueError, match="device"):
        StatisticsPart(stats=part_of([D], num_classes=2, dim=2, gram=True).stats,
                       clients=frozenset({"D", "E"}))  # fmt: skip


def _lda_devices(count: int) -> list[PrototypeUpdate]:
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(3, DIM))
    out = []
    for i in range(count):
        y = rng.integers(0, 3, size=int(rng.integers(4, 20)))
        x = cf.clip_rows((centres[y] + rng.normal(size=(len(y), DIM))) / 3.0)
        out.append(StatisticsRelease.of(cf.device_statistics(x, y, 3)).update(
            fleet="lab", round_=1, client=f"dev-{i}", bundle="f" * 64, method="lda"))  # fmt: skip
    return out


LDA_UPDATES = _lda_devices(20)


@settings(max_examples=40, deadline=None)
@given(groups=st.lists(st.integers(0, 4), min_size=len(LDA_UPDATES), max_size=len(LDA_UPDATES)))
def test_any_split_of_statistics_merged_solves_the_single_coordinators_head(
    groups: list[int],
) -> None:
    """As for the prototype sums: per group, then across groups in a shuffled order,
    equal to one sum over every client to 1e-12 relative, and so is the solved head."""
    split = [[u for u, g in zip(LDA_UPDATES, groups, strict=True) if g == k] for k in range(5)]
    parts = [part_of(s, num_classes=3, dim=DIM, gram=True) for s in split]
    order = np.random.default_rng(sum(groups)).permutation(len(parts))
    merged = merge_parts(parts[i] for i in order)
    whole = fleet_statistics(LDA_UPDATES, num_classes=3, dim=DIM)
    assert whole is not None and merged.stats.devices == whole.devices == len(LDA_UPDATES)
    np.testing.assert_array_equal(merged.stats.counts, whole.counts)
    np.testing.assert_allclose(merged.stats.sums, whole.sums, rtol=1e-12, atol=1e-15)
    assert merged.stats.gram is not None and whole.gram is not None
    np.testing.assert_allclose(merged.stats.gram, whole.gram, rtol=1e-12, atol=1e-15)
    lda = make_strategy("lda")
    assert isinstance(lda, ClosedForm)
    got = lda.solve_statistics(merged.stats)
    want = lda.aggregate(LDA_UPDATES, num_classes=3, dim=DIM)
    scale = float(np.abs(want.global_prototypes).max())
    np.testing.assert_allclose(got.global_prototypes, want.global_prototypes, rtol=1e-12,
                               atol=1e-12 * scale)  # fmt: skip


def _statistics_message(**kw: object) -> PartialMessage:
    nothing = StatisticsRelease.nothing(DIM).update(
        fleet="lab", round_=1, client="dev-9", bundle="f" * 64, method="lda"
    )
    updates = [*LDA_UPDATES[:4], nothing]
    fields = {
        "fleet": "lab", "run": "run-a", "round": 3, "worker": "w1",
        "partial": partial_of(updates, num_classes=3, dim=DIM),
        "copies": {u.client: Copy(digest=f"{i:064x}", stored_at=1.5) for i, u in enumerate(updates)},
        "statistics": part_of(updates, num_classes=3, dim=DIM, gram=True),
        "retract": {"dev-7": 1, "dev-8": 0},
        "retraction": part_of(LDA_UPDATES[7:8], num_classes=3, dim=DIM, gram=True),
    }  # fmt: skip
    return PartialMessage(**{**fields, **kw})  # type: ignore[arg-type]


def test_a_partial_with_statistics_round_trips_bit_for_bit() -> None:
    sent = _statistics_message()
    back = PartialMessage.from_wire(sent.to_wire())
    assert back.retract == {"dev-7": 1, "dev-8": 0}
    for mine, theirs in ((sent.statistics, back.statistics), (sent.retraction, back.retraction)):
        assert mine is not None and theirs is not None and mine.clients == theirs.clients
        for name in ("counts", "sums", "gram", "holders"):
            np.testing.assert_array_equal(getattr(theirs.stats, name), getattr(mine.stats, name))
        assert theirs.stats.devices == mine.stats.devices
    assert back.statistics is not None and back.statistics.clients == {f"dev-{i}" for i in range(4)}
    # FedCOF's kind: the scatter travels whole.
    fedcof = [release(f"c{i}", [[0.6, 0.8], [1, 0]], [0, 1], method="fedcof") for i in range(2)]
    sent = PartialMessage(
        fleet="lab", run="run-a", round=1, worker="w2",
        partial=partial_of(fedcof, num_classes=2, dim=2),
        copies={u.client: Copy(digest="ab" * 32, stored_at=0.0) for u in fedcof},
        statistics=part_of(fedcof, num_classes=2, dim=2, gram=False),
    )  # fmt: skip
    back = PartialMessage.from_wire(sent.to_wire())
    assert back.statistics is not None and sent.statistics is not None
    np.testing.assert_array_equal(back.statistics.stats.scatter, sent.statistics.stats.scatter)


def _damaged(change: Callable[[dict], None]) -> bytes:
    obj = unpack(_statistics_message().to_wire(), max_bytes=1 << 30)
    change(obj)
    return pack(obj)


@pytest.mark.parametrize(
    "change",
    [
        lambda o: o.update(v=2),  # the version before the statistics
        lambda o: o["statistics"].update(gram=o["statistics"]["gram"][:-8]),  # a short triangle
        lambda o: o["statistics"].update(scatter=b"\0" * 8 * 3 * DIM * DIM),  # both kinds
        lambda o: o["statistics"].update(gram=None),  # neither kind
        lambda o: o["statistics"].update(counts=np.full(3, np.nan).tobytes()),
        lambda o: o["statistics"].update(devices=5),  # not one per client
        lambda o: o["statistics"].update(clients=["dev-0", "dev-0", "dev-1", "dev-2"]),
        lambda o: o["statistics"]["clients"].__setitem__(0, "dev-42"),  # not in the partial
        lambda o: o["statistics"].update(extra=1),
        lambda o: o.update(retract={}),  # a retraction nobody asked for
        lambda o: o.update(retract={"dev-7": 3, "dev-8": 0}),  # not an earlier round
        lambda o: o.update(retract=[["dev-7", 1]]),
        lambda o: o["retraction"].update(clients=["dev-6"]),  # a client not asked for
        lambda o: o.update(statistics=[]),
    ],
)
def test_a_damaged_statistics_partial_is_refused_as_malformed(change: Callable) -> None:
    with pytest.raises(MalformedPayload):
        PartialMessage.from_wire(_damaged(change))


def test_a_collect_request_asks_one_worker_for_earlier_statistics_back() -> None:
    ask = CollectRequest(fleet="lab", run="run-a", round=3, worker="w2", retract={"dev-1": 0})
    back = CollectRequest.from_wire(ask.to_wire())
    assert back == ask and back.retract == {"dev-1": 0}
    with pytest.raises(ValueError, match="one worker"):
        CollectRequest(fleet="lab", run="run-a", round=3, retract={"dev-1": 0})
    with pytest.raises(ValueError, match="before 3"):
        CollectRequest(fleet="lab", run="run-a", round=3, worker="w2", retract={"dev-1": 3})
