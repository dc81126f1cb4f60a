"""Two coordinator workers on one MQTT 5 shared subscription add up to one coordinator."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from coordinator.admission import Admission
from coordinator.partial import RAW, OverlapError, global_prototypes, partial_of
from coordinator.partial_wire import (
    PartialMessage,
    collect_topic,
    combine,
    partial_filter,
)
from coordinator.strategies import make_strategy
from coordinator.worker import Worker, shared_update_filter
from fleet.transports.broker import MosquittoBroker
from protocol import DEFAULT_MAX_PAYLOAD_BYTES, MalformedPayload, PayloadTooLarge, update_topic
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


class Tally:
    """Counts the workers' handled updates; ``wait`` blocks until ``count`` of them."""

    def __init__(self) -> None:
        self.handled = 0
        self._cond = threading.Condition()

    def __call__(self, reason: str | None) -> None:
        with self._cond:
            self.handled += 1
            self._cond.notify_all()

    def wait(self, count: int, *, timeout: float = 20.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.handled >= count, timeout=timeout):
                raise TimeoutError(f"the workers handled {self.handled} of {count} updates")


def test_the_shared_filter_names_the_group_and_the_fleets_updates() -> None:
    assert shared_update_filter("agg", "lab") == "$share/agg/protofleet/v1/lab/update/+"
    with pytest.raises(ValueError):
        shared_update_filter("a/b", "lab")


def test_a_partial_message_round_trips_and_refuses_damage() -> None:
    message = PartialMessage(
        fleet="lab", round=1, worker="w1", partial=partial_of(UPDATES, num_classes=3, dim=DIM)
    )
    back = PartialMessage.from_wire(message.to_wire())
    assert (back.fleet, back.round, back.worker) == ("lab", 1, "w1")
    assert back.partial.clients == message.partial.clients
    for name in ("weighted", "counts", "plain", "holders"):
        np.testing.assert_array_equal(getattr(back.partial, name), getattr(message.partial, name))
    with pytest.raises(MalformedPayload):
        PartialMessage.from_wire(message.to_wire()[:-3])
    with pytest.raises(PayloadTooLarge):
        PartialMessage.from_wire(message.to_wire(), max_bytes=100)
    with pytest.raises(MalformedPayload, match="bad partial sum"):
        PartialMessage.from_wire(message.to_wire().replace(b"dev-1", b"dev 1", 1))


def test_combine_refuses_a_worker_twice_another_round_and_a_shared_client() -> None:
    def msg(worker: str, round_: int, updates: list) -> PartialMessage:
        part = partial_of(updates, num_classes=3, dim=DIM)
        return PartialMessage(fleet="lab", round=round_, worker=worker, partial=part)

    with pytest.raises(ValueError, match="one worker"):
        combine([msg("w1", 1, UPDATES[:2]), msg("w1", 1, UPDATES[2:4])], fleet="lab", round_=1)
    with pytest.raises(ValueError, match="another fleet or round from w2"):
        combine([msg("w1", 1, UPDATES[:2]), msg("w2", 2, UPDATES[2:4])], fleet="lab", round_=1)
    with pytest.raises(OverlapError):
        combine([msg("w1", 1, UPDATES[:3]), msg("w2", 1, UPDATES[2:4])], fleet="lab", round_=1)


def test_a_worker_keeps_the_first_copy_and_counts_what_it_refuses() -> None:
    worker = Worker(name="w1", group="aggregators", admission=ADMISSION)
    first = UPDATES[0]
    topic = update_topic("lab", first.client)
    assert worker.offer(first.to_wire(), topic=topic) is None
    assert worker.offer(first.to_wire(), topic=topic) == "duplicate"
    assert worker.offer(first.to_wire(), topic=update_topic("lab", "other")) == "client_mismatch"
    assert worker.offer(b"\x80", topic=topic) == "field"  # an empty map: fields missing
    assert worker.offer(bytes(DEFAULT_MAX_PAYLOAD_BYTES + 1), topic=topic) == "too_large"
    assert worker.rejected == {"duplicate": 1, "client_mismatch": 1, "field": 1, "too_large": 1}
    assert worker.partial(1).clients == {first.client}
    assert worker.partial(2).clients == frozenset()


@pytest.mark.broker
@pytest.mark.slow
def test_two_workers_on_one_shared_subscription_equal_one_coordinator(
    mosquitto: MosquittoBroker,
) -> None:
    tally = Tally()
    host, port = mosquitto.address.host, mosquitto.address.port
    common = dict(group="aggregators", admission=ADMISSION, host=host, port=port, on_offer=tally)
    with (
        Worker(name="w1", max_payload_bytes=4096, **common) as w1,  # type: ignore[arg-type]
        Worker(name="w2", max_payload_bytes=4096, **common) as w2,  # type: ignore[arg-type]
        stand_ins(mosquitto) as fleet,
    ):
        fleet.send(UPDATES)
        fleet.publish(update_topic("lab", "junk"), b"\xc1 not msgpack")
        fleet.publish(update_topic("lab", "huge"), bytes(5000))
        tally.wait(len(UPDATES) + 2)

        p1, p2 = w1.partial(1), w2.partial(1)
        print(f"\nworker w1 holds {len(p1.clients)} updates, w2 {len(p2.clients)}")
        # Mosquitto hands a shared subscription's messages to its members in turn.
        assert len(p1.clients) > 0 and len(p2.clients) > 0
        assert not p1.clients & p2.clients
        assert p1.clients | p2.clients == {u.client for u in UPDATES}
        rejected = {
            k: w1.rejected.get(k, 0) + w2.rejected.get(k, 0) for k in ("malformed", "too_large")
        }
        assert rejected == {"malformed": 1, "too_large": 1}

        # The combiner's path: ask every worker over the broker, decode what comes back.
        with connected(mosquitto.address, "combiner", subscribe=(partial_filter("lab"),)) as (
            pub,
            inbox,
        ):
            pub.publish(collect_topic("lab"), b"1", qos=1).wait_for_publish(10)
            messages = [PartialMessage.from_wire(m.payload) for m in inbox.wait(2, timeout=20)]
    assert sorted(m.worker for m in messages) == ["w1", "w2"]
    merged = combine(messages, fleet="lab", round_=1)

    # Partial sums are of the rows and counts as sent: the default median defences need
    # the whole round at once (coordinator/partial.py::RAW), so the single coordinator
    # they equal is one without them.
    single = make_strategy("fedpcl", robust=RAW).aggregate(UPDATES, num_classes=3, dim=DIM)
    values, has = global_prototypes(merged)
    assert tuple(int(c) for c in np.flatnonzero(has)) == single.global_classes
    # Equal up to float64 rounding (see coordinator/partial.py::global_prototypes).
    np.testing.assert_allclose(values[has], single.global_prototypes, rtol=1e-12, atol=1e-15)
