"""Two coordinator workers on one MQTT 5 shared subscription add up to one coordinator.

The building blocks, unsigned: the shared filter, the tier's messages, the combiner's
de-duplication, and the worker's intake. Signatures, receipts and restarts:
tests/test_worker_intake.py."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from coordinator.admission import Admission
from coordinator.decision import Decision
from coordinator.keys import CoordinatorKeys
from coordinator.strategies import make_strategy
from coordinator.tier.intake import Intake
from coordinator.tier.partial import RAW, OverlapError, global_prototypes, partial_of
from coordinator.tier.partial_wire import (
    CollectRequest,
    Copy,
    PartialMessage,
    collect_topic,
    combine,
    exclusions,
    partial_filter,
)
from coordinator.tier.worker import Worker, shared_update_filter
from coordinator.tier.worker_store import WorkerStore
from fleet.transports.broker import MosquittoBroker
from protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MalformedPayload,
    PayloadTooLarge,
    PrototypeUpdate,
    RoundAnnouncement,
    round_topic,
    update_topic,
)
from runtime.transport import MqttSettings
from tests.coordinator_helpers import BUNDLE, CLASSES, DIM, stand_in_update, stand_ins
from tests.mqtt_helpers import connected

ADMISSION = Admission.for_fleet(
    fleet="lab",
    bundle=BUNDLE,
    method="fedpcl",
    classes=len(CLASSES),
    dim=DIM,
    max_count=100_000.0,
    max_value=1_000.0,
)
UPDATES = [stand_in_update(i, 1) for i in range(40)]
RUN = "run-a"


def announcement(round_: int, *, run: str = RUN, run_started: float = 1.0) -> RoundAnnouncement:
    """The coordinator's (unsigned) announcement opening ``round_``."""
    return RoundAnnouncement(
        fleet="lab", round=round_, run=run, run_started=run_started, bundle=BUNDLE,
        method="fedpcl", classes=CLASSES, dim=DIM, deadline=2e9,
    )  # fmt: skip


def intake(tmp_path: Path, name: str, **kw: object) -> Intake:
    """An insecure worker intake with its own database under ``tmp_path``."""
    store = WorkerStore(tmp_path / f"worker-{name}.sqlite3")
    return Intake(name=name, admission=ADMISSION, keys=CoordinatorKeys(), store=store, **kw)  # type: ignore[arg-type]


def copies(updates: list[PrototypeUpdate], at: float = 0.0) -> dict[str, Copy]:
    return {u.client: Copy(digest=f"{i:064x}", stored_at=at) for i, u in enumerate(updates)}


def message(worker: str, updates: list[PrototypeUpdate], *, round_: int = 1) -> PartialMessage:
    return PartialMessage(
        fleet="lab", run=RUN, round=round_, worker=worker,
        partial=partial_of(updates, num_classes=3, dim=DIM), copies=copies(updates),
    )  # fmt: skip


class Tally:
    """Counts the workers' handled updates; ``wait`` blocks until ``count`` of them."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self._cond = threading.Condition()

    def __call__(self, decision: Decision) -> None:
        with self._cond:
            self.decisions.append(decision)
            self._cond.notify_all()

    def wait(self, count: int, *, timeout: float = 20.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.decisions) >= count, timeout=timeout):
                raise TimeoutError(f"the workers handled {len(self.decisions)} of {count} updates")


def test_the_shared_filter_names_the_group_and_the_fleets_updates() -> None:
    assert shared_update_filter("agg", "lab") == "$share/agg/protofleet/v1/lab/update/+"
    with pytest.raises(ValueError):
        shared_update_filter("a/b", "lab")


def test_a_partial_message_round_trips_and_refuses_damage() -> None:
    sent = PartialMessage(
        fleet="lab", run=RUN, round=1, worker="w1",
        partial=partial_of(UPDATES[1:], num_classes=3, dim=DIM),
        copies=copies(UPDATES[1:], at=1234.5), excluded=frozenset({"dev-0"}),
    )  # fmt: skip
    back = PartialMessage.from_wire(sent.to_wire())
    assert (back.fleet, back.run, back.round, back.worker) == ("lab", RUN, 1, "w1")
    assert back.partial.clients == sent.partial.clients
    assert back.copies == sent.copies and back.excluded == {"dev-0"}
    for name in ("weighted", "counts", "plain", "holders"):
        np.testing.assert_array_equal(getattr(back.partial, name), getattr(sent.partial, name))
    with pytest.raises(MalformedPayload):
        PartialMessage.from_wire(sent.to_wire()[:-3])
    with pytest.raises(PayloadTooLarge):
        PartialMessage.from_wire(sent.to_wire(), max_bytes=100)
    with pytest.raises(MalformedPayload, match="bad partial sum"):
        PartialMessage.from_wire(sent.to_wire().replace(b"dev-1", b"dev 1", 1))
    with pytest.raises(ValueError, match="exactly"):
        PartialMessage(fleet="lab", run=RUN, round=1, worker="w1", partial=sent.partial, copies={})


def test_a_collect_request_round_trips_and_names_one_worker_when_it_excludes() -> None:
    everyone = CollectRequest(fleet="lab", run=RUN, round=3)
    assert CollectRequest.from_wire(everyone.to_wire()) == everyone
    assert everyone.addressed_to("w1") and everyone.addressed_to("w2")
    one = CollectRequest(fleet="lab", run=RUN, round=3, worker="w2", exclude=frozenset({"d-1"}))
    assert CollectRequest.from_wire(one.to_wire()) == one
    assert one.addressed_to("w2") and not one.addressed_to("w1")
    with pytest.raises(ValueError, match="one worker"):
        CollectRequest(fleet="lab", run=RUN, round=3, exclude=frozenset({"d-1"}))
    with pytest.raises(MalformedPayload):
        CollectRequest.from_wire(b"3")  # the version 1 request: a bare round number


def test_combine_refuses_a_worker_twice_another_round_and_a_shared_client() -> None:
    with pytest.raises(ValueError, match="one worker"):
        combine(
            [message("w1", UPDATES[:2]), message("w1", UPDATES[2:4])],
            fleet="lab",
            run=RUN,
            round_=1,
        )
    with pytest.raises(ValueError, match="another fleet, run or round from w2"):
        combine(
            [message("w1", UPDATES[:2]), message("w2", UPDATES[2:4], round_=2)],
            fleet="lab", run=RUN, round_=1,
        )  # fmt: skip
    with pytest.raises(OverlapError):
        combine(
            [message("w1", UPDATES[:3]), message("w2", UPDATES[2:4])],
            fleet="lab",
            run=RUN,
            round_=1,
        )


def test_exclusions_keep_one_copy_of_each_shared_client() -> None:
    a, b, c = message("w2", UPDATES[:3]), message("w1", UPDATES[2:5]), message("w3", UPDATES[2:3])
    assert exclusions([a, c]) == {"w3": {"dev-2"}}
    # Equal copies (one digest): the worker whose id sorts first keeps it, whatever the clocks.
    same = {
        m.worker: PartialMessage(
            fleet="lab",
            run=RUN,
            round=1,
            worker=m.worker,
            partial=m.partial,
            copies={k: Copy(digest="ab" * 32, stored_at=at) for k in m.partial.clients},
        )
        for m, at in ((a, 1.0), (b, 9.0), (c, 5.0))
    }
    assert exclusions(same.values()) == {"w2": {"dev-2"}, "w3": {"dev-2"}}
    # Copies that differ: the one stored first stands (message() stores at 0.0, ids differ).
    later = PartialMessage(
        fleet="lab", run=RUN, round=1, worker="w0", partial=c.partial,
        copies={"dev-2": Copy(digest="cd" * 32, stored_at=7.0)},
    )  # fmt: skip
    assert exclusions([a, later]) == {"w0": {"dev-2"}}
    assert exclusions([a, message("w9", UPDATES[3:])]) == {}


def test_an_intake_keeps_the_first_copy_and_counts_what_it_refuses(tmp_path: Path) -> None:
    worker = intake(tmp_path, "w1")
    first = UPDATES[0]
    topic = update_topic("lab", first.client)
    assert worker.offer(first.to_wire(), topic=topic).reason == "wrong_round"  # none heard
    assert worker.hear(announcement(1).to_wire()) is None
    accepted = worker.offer(first.to_wire(), topic=topic)
    assert accepted.accepted and accepted.digest is not None
    again = worker.offer(first.to_wire(), topic=topic)
    assert (again.reason, again.digest) == ("duplicate", accepted.digest)
    assert worker.offer(first.to_wire(), topic=update_topic("lab", "other")).reason == (
        "client_mismatch"
    )
    assert worker.offer(b"\x80", topic=topic).reason == "field"  # an empty map: fields missing
    assert worker.offer(bytes(DEFAULT_MAX_PAYLOAD_BYTES + 1), topic=topic).reason == "too_large"
    assert worker.offer(stand_in_update(1, 2).to_wire(), topic=topic).reason == "client_mismatch"
    late = stand_in_update(1, 2)
    assert worker.offer(late.to_wire(), topic=update_topic("lab", late.client)).reason == (
        "wrong_round"
    )
    assert worker.rejected == {
        "wrong_round": 2, "duplicate": 1, "client_mismatch": 2, "field": 1, "too_large": 1,
    }  # fmt: skip
    assert worker.collect(run=RUN, round_=1).partial.clients == {first.client}
    assert worker.collect(run=RUN, round_=2).partial.clients == frozenset()


def test_an_intake_follows_announcements_forward_only(tmp_path: Path) -> None:
    worker = intake(tmp_path, "w1")
    assert worker.hear(announcement(3).to_wire()) is None
    assert worker.hear(announcement(2).to_wire()) == "stale_announcement"  # a replay
    assert worker.hear(b"\xc1") == "foreign_announcement"
    assert worker.hear(announcement(4, run="run-old", run_started=0.5).to_wire()) == (
        "stale_announcement"
    )
    assert worker.hear(announcement(0, run="run-b", run_started=2.0).to_wire()) is None
    open_ = worker.open_round
    assert open_ is not None and (open_.run, open_.round) == ("run-b", 0)
    worker.store.close()
    assert intake(tmp_path, "w1").open_round == open_  # kept in its database
    with pytest.raises(ValueError, match="worker 'w1'"):
        intake(tmp_path, "w1").store.bind(fleet="lab", worker="w2")


def test_a_collected_round_takes_no_more_updates_and_excludes_on_request(tmp_path: Path) -> None:
    worker = intake(tmp_path, "w1")
    worker.hear(announcement(1).to_wire())
    for u in UPDATES[:3]:
        assert worker.offer(u.to_wire(), topic=update_topic("lab", u.client)).accepted
    whole = worker.collect(run=RUN, round_=1)
    assert whole.partial.clients == {"dev-0", "dev-1", "dev-2"}
    u = UPDATES[3]
    assert worker.offer(u.to_wire(), topic=update_topic("lab", u.client)).reason == "wrong_round"
    less = worker.collect(run=RUN, round_=1, exclude={"dev-1"})
    assert less.partial.clients == {"dev-0", "dev-2"} and less.excluded == {"dev-1"}
    expected = partial_of([UPDATES[0], UPDATES[2]], num_classes=3, dim=DIM)
    np.testing.assert_allclose(less.partial.weighted, expected.weighted, rtol=1e-15)
    assert less.copies["dev-0"] == whole.copies["dev-0"]


@pytest.mark.broker
@pytest.mark.slow
def test_two_workers_on_one_shared_subscription_equal_one_coordinator(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    tally = Tally()
    settings = MqttSettings(host=mosquitto.address.host, port=mosquitto.address.port)
    small = {"max_payload_bytes": 4096}
    with stand_ins(mosquitto) as fleet:
        fleet.publish(round_topic("lab"), announcement(1).to_wire(), retain=True)
        with (
            Worker(
                intake=intake(tmp_path, "w1", **small), group="aggregators",
                mqtt_settings=settings, on_update=tally,
            ) as w1,
            Worker(
                intake=intake(tmp_path, "w2", **small), group="aggregators",
                mqtt_settings=settings, on_update=tally,
            ) as w2,
        ):  # fmt: skip
            assert w1.wait_heard(10) and w2.wait_heard(10)
            fleet.send(UPDATES)
            fleet.publish(update_topic("lab", "junk"), b"\xc1 not msgpack")
            fleet.publish(update_topic("lab", "huge"), bytes(5000))
            tally.wait(len(UPDATES) + 2)

            # The combiner's path: ask every worker over the broker, decode what comes back.
            with connected(mosquitto.address, "combiner", subscribe=(partial_filter("lab"),)) as (
                pub,
                inbox,
            ):
                request = CollectRequest(fleet="lab", run=RUN, round=1)
                pub.publish(collect_topic("lab"), request.to_wire(), qos=1).wait_for_publish(10)
                messages = [PartialMessage.from_wire(m.payload) for m in inbox.wait(2, timeout=20)]
            rejected = {
                k: w1.intake.rejected.get(k, 0) + w2.intake.rejected.get(k, 0)
                for k in ("malformed", "too_large")
            }
    assert rejected == {"malformed": 1, "too_large": 1}
    assert sorted(m.worker for m in messages) == ["w1", "w2"]
    p1, p2 = (m.partial for m in sorted(messages, key=lambda m: m.worker))
    print(f"\nworker w1 holds {len(p1.clients)} updates, w2 {len(p2.clients)}")
    # Mosquitto hands a shared subscription's messages to its members in turn.
    assert len(p1.clients) > 0 and len(p2.clients) > 0
    assert not p1.clients & p2.clients
    assert p1.clients | p2.clients == {u.client for u in UPDATES}
    assert exclusions(messages) == {}
    merged = combine(messages, fleet="lab", run=RUN, round_=1)

    # Partial sums are of the rows and counts as sent: the default median defences need
    # the whole round at once (coordinator/tier/partial.py::RAW), so the single coordinator
    # they equal is one without them.
    single = make_strategy("fedpcl", robust=RAW).aggregate(UPDATES, num_classes=3, dim=DIM)
    values, has = global_prototypes(merged)
    assert tuple(int(c) for c in np.flatnonzero(has)) == single.global_classes
    # Equal up to float64 rounding (see coordinator/tier/partial.py::global_prototypes).
    np.testing.assert_allclose(values[has], single.global_prototypes, rtol=1e-12, atol=1e-15)
