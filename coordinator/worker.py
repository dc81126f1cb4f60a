"""One coordinator worker: a member of an MQTT 5 shared subscription on the fleet's updates.

The broker hands each update published on ``protofleet/v1/<fleet>/update/<client>`` to one
member of the group ``$share/<group>/...``, so N workers each see about 1/N of the fleet.
A worker decodes and screens each update exactly as the coordinator does before storing it
(the protocol's decoder under the payload cap, then :class:`coordinator.admission.Admission`),
keeps the first update per (round, client) and only the running :class:`PartialSum` of a
round, and publishes that partial on request (:mod:`coordinator.partial_wire`).

A tested building block, not a service (docs/scale.md says what is missing): it checks no
signatures, sends no receipts and keeps its sums in memory only.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from coordinator.admission import Admission
from coordinator.partial import PartialSum, partial_of
from coordinator.partial_wire import PartialMessage, collect_topic, partial_topic
from protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    ProtocolError,
    PrototypeUpdate,
    parse_topic,
    update_filter,
    validate_id,
)


def shared_update_filter(group: str, fleet: str) -> str:
    """``$share/<group>/protofleet/v1/<fleet>/update/+`` (MQTT 5, section 4.8.2)."""
    return f"$share/{validate_id(group, field='group')}/{update_filter(fleet)}"


class _Sums:
    """A round's running sums, added to in place: a worker that merged a fresh frozen
    partial per update would copy its growing client set every time."""

    def __init__(self, num_classes: int, dim: int) -> None:
        empty = PartialSum.empty(num_classes=num_classes, dim=dim)
        self.weighted, self.counts = empty.weighted, empty.counts
        self.plain, self.holders = empty.plain, empty.holders
        self.clients: set[str] = set()

    def add(self, one: PartialSum) -> None:
        self.weighted += one.weighted
        self.counts += one.counts
        self.plain += one.plain
        self.holders += one.holders
        self.clients |= one.clients

    def frozen(self) -> PartialSum:
        return PartialSum(
            weighted=self.weighted.copy(),
            counts=self.counts.copy(),
            plain=self.plain.copy(),
            holders=self.holders.copy(),
            clients=frozenset(self.clients),
        )


class Worker:
    """``with Worker(...) as w:`` connects, subscribes and waits for the SUBACK.

    ``on_offer`` is called (on paho's network thread) after each update is handled, with
    the reason it was refused or None when it was added.
    """

    def __init__(
        self,
        *,
        name: str,
        group: str,
        admission: Admission,
        host: str = "127.0.0.1",
        port: int = 1883,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        on_offer: Callable[[str | None], None] | None = None,
    ) -> None:
        self.name = validate_id(name, field="name")
        self.fleet = admission.fleet
        self.admission = admission
        self.host, self.port = host, port
        self.max_payload_bytes = max_payload_bytes
        self.filter = shared_update_filter(group, self.fleet)
        self._on_offer = on_offer
        self._lock = threading.Lock()
        self._sums: dict[int, _Sums] = {}
        self._rejected: Counter[str] = Counter()
        self._subscribed = threading.Event()
        self._refused: list[str] = []
        # MQTT 5: shared subscriptions do not exist in 3.1.1, which the device-facing
        # services speak. A clean start, so a restarted worker does not inherit a session
        # whose queued updates the group already gave to another member.
        self._client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"{self.fleet}-worker-{self.name}",
            protocol=mqtt.MQTTv5,
        )
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message

    def start(self, *, timeout: float = 10.0) -> Worker:
        self._client.connect(self.host, self.port, keepalive=30, clean_start=True)
        self._client.loop_start()
        if not self._subscribed.wait(timeout):
            self.stop()
            raise TimeoutError(f"worker {self.name}: no SUBACK within {timeout} s")
        if self._refused:
            self.stop()
            raise ConnectionError(f"worker {self.name}: broker refused {self._refused}")
        return self

    def stop(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def rejected(self) -> dict[str, int]:
        """Updates refused, by reason (the protocol's and the admission's names)."""
        with self._lock:
            return dict(self._rejected)

    def partial(self, round_: int) -> PartialSum:
        """What this worker holds of ``round_`` (empty if it saw none of it)."""
        with self._lock:
            sums = self._sums.get(round_)
            if sums is None:
                return PartialSum.empty(
                    num_classes=self.admission.num_classes, dim=self.admission.dim
                )
            return sums.frozen()

    def forget(self, round_: int) -> None:
        """Drop a round's sums once the combiner has them."""
        with self._lock:
            self._sums.pop(round_, None)

    def publish_partial(self, round_: int) -> mqtt.MQTTMessageInfo:
        """Publish this worker's partial of ``round_`` (QoS 1) on its partial topic."""
        message = PartialMessage(
            fleet=self.fleet, round=round_, worker=self.name, partial=self.partial(round_)
        )
        return self._client.publish(partial_topic(self.fleet, self.name), message.to_wire(), qos=1)

    def offer(self, payload: bytes | bytearray, *, topic: str) -> str | None:
        """Decode, screen and add one update that came on ``topic``; the reason it was
        refused, or None."""
        try:
            reason = self._add(payload, topic_client=parse_topic(topic).client)
        except ProtocolError as exc:  # an unsafe id in the topic's client level
            reason = exc.reason
        if reason is not None:
            with self._lock:
                self._rejected[reason] += 1
        if self._on_offer is not None:
            self._on_offer(reason)
        return reason

    def _add(self, payload: bytes | bytearray, *, topic_client: str | None) -> str | None:
        try:
            update = PrototypeUpdate.from_wire(payload, max_bytes=self.max_payload_bytes)
        except ProtocolError as exc:
            return exc.reason
        problem = self.admission.check(update, topic_client=topic_client)
        if problem is not None:
            return problem
        one = partial_of([update], num_classes=self.admission.num_classes, dim=self.admission.dim)
        with self._lock:
            sums = self._sums.setdefault(
                update.round, _Sums(self.admission.num_classes, self.admission.dim)
            )
            if update.client in sums.clients:
                return "duplicate"  # QoS 1 may deliver twice; the first copy stands
            sums.add(one)
        return None

    def _on_connect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: object,
        reason: ReasonCode,
        properties: object,
    ) -> None:
        if reason.is_failure:
            self._refused.append(f"connect: {reason}")
            self._subscribed.set()
            return
        qos1 = SubscribeOptions(qos=1)
        client.subscribe([(self.filter, qos1), (collect_topic(self.fleet), qos1)])

    def _on_subscribe(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reasons: list[ReasonCode],
        properties: object,
    ) -> None:
        self._refused.extend(f"subscribe: {r}" for r in reasons if r.is_failure)
        self._subscribed.set()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        if message.topic == collect_topic(self.fleet):
            round_ = _round_of(message.payload)
            if round_ is not None:
                self.publish_partial(round_)  # not awaited: this is paho's network thread
            return
        self.offer(message.payload, topic=message.topic)


def _round_of(payload: bytes | bytearray) -> int | None:
    """A collect request's payload: the round number in ASCII decimal."""
    text = payload.decode("ascii", errors="replace")
    if not text.isdigit() or len(text) > 10 or int(text) > 2**31 - 1:
        return None
    return int(text)
