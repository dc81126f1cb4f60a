"""The one MQTT connection both services use (``runtime/mqtt_link.py``): paho's callbacks
in, "connected", "message" and "dropped" out, with acknowledgement, reconnect waits and
takeover detection as the services rely on them. Against a real Mosquitto where a broker
takes part; the reconnect arithmetic by hand, driving paho's callbacks as paho does."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator
from typing import cast

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from fleet.transports.broker import BrokerAddress, free_port
from runtime.bulkread import BulkReadClient
from runtime.mqtt_link import MqttLink, Reconnect
from runtime.transport import MqttSettings
from tests.mqtt_helpers import connected

NO_FLAGS = mqtt.ConnectFlags(session_present=False)
LOST = mqtt.DisconnectFlags(is_disconnect_packet_from_server=False)


class Highest(random.Random):
    """Draws the top of every range: each jittered wait is its cap, 2, 4, 8... s."""

    def uniform(self, a: float, b: float) -> float:
        return b


class Lowest(random.Random):
    """Draws the bottom of every range: every wait is ``reconnect_min_s``."""

    def uniform(self, a: float, b: float) -> float:
        return a


class Lines(logging.Handler):
    """What a link logs (its service's logger in the services), with when."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.records: list[logging.LogRecord] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    @property
    def lines(self) -> list[str]:
        with self._cond:
            return [r.getMessage() for r in self.records]

    def wait(self, text: str, *, count: int = 1, timeout: float = 20.0) -> list[logging.LogRecord]:
        """The first ``count`` records that contain ``text``, once there are that many."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._with(text)) >= count, timeout):
                raise TimeoutError(f"no {count} lines with {text!r} in {timeout} s: {self.lines}")
            return self._with(text)[:count]

    def _with(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if text in r.getMessage()]


def attached_lines(
    request: pytest.FixtureRequest, *, prefix: str, level: int = logging.INFO
) -> Iterator[Lines]:
    """A :class:`Lines` on a logger of the test's own, from ``level`` on, for a fixture."""
    logger = logging.getLogger(f"{prefix}.{request.node.name}")
    logger.setLevel(level)
    handler = Lines(logger)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def lines(request: pytest.FixtureRequest) -> Iterator[Lines]:
    yield from attached_lines(request, prefix="tests.mqtt_link")


class Service:
    """A stand-in service: records the link's events; ``then`` runs on each connect."""

    def __init__(self, *, done: Callable[[mqtt.MQTTMessage], bool] = lambda m: True) -> None:
        self.done = done
        self.then: Callable[[], object] = lambda: None
        self.connected = 0
        self.messages: list[mqtt.MQTTMessage] = []
        self.dropped: list[str] = []
        self._cond = threading.Condition()

    def on_connected(self) -> None:
        self.then()
        with self._cond:
            self.connected += 1
            self._cond.notify_all()

    def on_message(self, message: mqtt.MQTTMessage) -> bool:
        with self._cond:
            self.messages.append(message)
            self._cond.notify_all()
        return self.done(message)

    def on_dropped(self, reason: str) -> None:
        with self._cond:
            self.dropped.append(reason)
            self._cond.notify_all()

    def payloads(self) -> list[bytes]:
        with self._cond:
            return [bytes(m.payload) for m in self.messages]

    def wait(self, predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise TimeoutError(f"no {what} in {timeout} s")


def link(
    service: Service,
    lines: Lines,
    *,
    address: BrokerAddress | None = None,
    client_id: str = "link",
    reconnect: Reconnect | None = None,
    manual_ack: bool = False,
    rng: random.Random | None = None,
    stopping: Callable[[], bool] = lambda: False,
    reconnect_max_s: float = 60.0,
) -> MqttLink:
    """A link for ``service``, to ``address`` or to a port nothing listens on."""
    where = address or BrokerAddress("127.0.0.1", free_port())
    return MqttLink(
        settings=MqttSettings(host=where.host, port=where.port, reconnect_max_s=reconnect_max_s),
        client_id=client_id,
        subscriptions=("t/link/#",),
        on_connected=service.on_connected,
        on_message=service.on_message,
        on_dropped=service.on_dropped,
        reconnect=reconnect or Reconnect(jittered=True),
        manual_ack=manual_ack,
        stopping=stopping,
        logger=lines.logger,
        rng=rng or Lowest(),
    )


def refused(link: MqttLink) -> None:
    """A failed attempt, as paho's thread reports one: inside its ``except OSError``."""
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except OSError:
        assert link.client.on_connect_fail is not None
        link.client.on_connect_fail(link.client, None)


def answered(link: MqttLink, reason: str = "Success") -> None:
    on_connect = cast(mqtt.CallbackOnConnect_v2, link.client.on_connect)
    on_connect(link.client, None, NO_FLAGS, ReasonCode(PacketTypes.CONNACK, reason), None)


def lost(link: MqttLink) -> None:
    on_disconnect = cast(mqtt.CallbackOnDisconnect_v2, link.client.on_disconnect)
    on_disconnect(
        link.client, None, LOST, ReasonCode(PacketTypes.DISCONNECT, "Unspecified error"), None
    )


def delays(link: MqttLink) -> tuple[int, int]:
    """paho's next wait and its ceiling, as the link last set them."""
    return link.client._reconnect_min_delay, link.client._reconnect_max_delay


def test_jittered_waits_grow_to_the_cap_and_start_again_after_a_connection(lines):
    # reconnect_min_s 1, max 5, every draw at the top of its range: the caps 1 * 2^n,
    # n the attempt, are 2, 4, then 5 (the maximum) for ever, each logged and given to paho.
    service = Service()
    device = link(service, lines, rng=Highest(), reconnect_max_s=5.0)
    port = device.settings.port
    assert delays(device) == (1, 5)  # before any failure: [mqtt]'s bounds
    seen = []
    for _ in range(4):
        refused(device)
        seen.append(delays(device))
    assert seen == [(2, 5), (4, 5), (5, 5), (5, 5)]
    why = f"cannot reach the broker at 127.0.0.1:{port} (Connection refused)"
    assert lines.lines == [f"{why}; reconnecting in {s} s" for s in (2, 4, 5, 5)]
    # A connection resets the count: the drop that ends it waits the first wait again.
    answered(device)
    assert service.connected == 1 and device.is_connected()
    lost(device)
    assert not device.is_connected() and service.dropped == ["Unspecified error"]
    assert lines.lines[-1] == "disconnected (Unspecified error); reconnecting in 2 s"
    assert delays(device) == (2, 5)


def test_unjittered_the_link_keeps_paho_s_doubling_under_its_cap(lines):
    # The coordinator: paho's own waits from 1 s, never over cap_s (5 s) though
    # [mqtt] reconnect_max_s says 60; the log says it retries, not when.
    service = Service()
    single = link(service, lines, reconnect=Reconnect(jittered=False, cap_s=5.0))
    assert delays(single) == (1, 5)
    refused(single)
    lost(single)
    assert delays(single) == (1, 5)  # untouched: paho doubles from there
    port = single.settings.port
    assert lines.lines == [
        f"cannot reach the broker at 127.0.0.1:{port} (Connection refused); retrying",
        "disconnected from broker (Unspecified error); paho will reconnect",
    ]
    answered(single, "Not authorized")  # a CONNACK that refuses: no connection to tell of
    assert service.connected == 0 and not single.is_connected()
    assert lines.lines[-1] == (
        "broker refused the connection: Not authorized; it refuses it again until that is "
        "fixed (next attempt in 5 s)"
    )
    with pytest.raises(ValueError, match="cap_s"):
        Reconnect(jittered=False, cap_s=0.0)


def test_a_stopping_service_hears_nothing_of_its_own_disconnect(lines):
    stopping = [False]
    service = Service()
    device = link(service, lines, stopping=lambda: stopping[0])
    answered(device)
    stopping[0] = True
    lost(device)
    refused(device)
    assert lines.lines == [] and service.dropped == []
    assert not device.is_connected()  # told or not, the connection is gone


@pytest.mark.broker
def test_the_service_hears_of_a_connection_once_subscribed_and_its_last_word_is_kept(
    mosquitto, lines
):
    service = Service()
    device = link(service, lines, address=mosquitto.address)
    # Published from the connected event: it comes back only if the subscription was
    # asked for first (the broker takes one connection's packets in order).
    service.then = lambda: device.publish("t/link/hello", b"hello")
    assert isinstance(device.client, BulkReadClient)  # the bulk reader, as the services get
    assert device.healthy()  # not started: nothing to watch yet
    with connected(mosquitto.address, "watch", subscribe=("t/last",)) as (_, watch):
        device.start()
        assert device.wait_connected(timeout=10) and device.healthy()
        service.wait(lambda: service.payloads() == [b"hello"], "message back")
        assert service.connected == 1 and service.messages[0].qos == 1
        device.close(last_word=("t/last", b"bye"))
        (last,) = watch.wait(1)
    assert (last.payload, last.qos) == (b"bye", 1)
    assert not device.is_connected() and not device.healthy()  # its network thread ended
    assert service.dropped == [] and lines.lines == []  # a close is not a lost connection
    with connected(mosquitto.address, "late", subscribe=("t/last",)) as (_, late):
        assert late.wait(1)[0].payload == b"bye"  # retained


@pytest.mark.broker
@pytest.mark.parametrize(
    "manual_ack, again",
    [(True, [b"keep-me", b"marker"]), (False, [b"marker"])],
    ids=["manual-ack", "paho-acks"],
)
def test_only_what_the_service_is_done_with_is_acknowledged(mosquitto, lines, manual_ack, again):
    # Under manual_ack (the coordinator: done once committed) a message the service is
    # not done with stays unacknowledged and comes again in the next connection of the
    # same session; without it (the agent) paho acknowledges every message on arrival.
    first = Service(done=lambda m: m.payload != b"keep-me")
    sent = [b"a", b"keep-me", b"b"]
    device = link(first, lines, address=mosquitto.address, manual_ack=manual_ack)
    device.start()
    try:
        assert device.wait_connected(timeout=10)
        with connected(mosquitto.address, "sender") as (pub, _):
            for payload in sent:
                pub.publish("t/link/x", payload, qos=1).wait_for_publish(10)
            first.wait(lambda: first.payloads() == sent, "three messages")
    finally:
        device.close()
    second = Service()
    device = link(second, lines, address=mosquitto.address, manual_ack=manual_ack)
    device.start()
    try:
        assert device.wait_connected(timeout=10)
        with connected(mosquitto.address, "sender") as (pub, _):
            pub.publish("t/link/x", b"marker", qos=1)  # anything queued comes before it
            second.wait(lambda: b"marker" in second.payloads(), "the marker")
    finally:
        device.close()
    assert second.payloads() == again
    assert second.messages[0].dup == manual_ack  # a redelivery says so


@pytest.mark.broker
def test_a_dropped_connection_is_told_and_the_link_comes_back_subscribed(mosquitto, lines):
    service = Service()
    device = link(service, lines, address=mosquitto.address, client_id="link-kicked")
    device.start()
    try:
        assert device.wait_connected(timeout=10)
        # Another client with this id and a clean session: the broker drops the link's
        # connection and forgets its subscriptions with its session.
        with connected(mosquitto.address, "link-kicked"):
            pass
        service.wait(lambda: len(service.dropped) == 1, "drop")
        (said,) = lines.wait("disconnected (")
        assert said.getMessage().endswith("; reconnecting in 1 s")  # reconnect_min_s, drawn low
        service.wait(lambda: service.connected == 2, "second connection")
        assert device.wait_connected(timeout=10)
        with connected(mosquitto.address, "sender") as (pub, _):
            pub.publish("t/link/after", b"after", qos=1).wait_for_publish(10)
            service.wait(lambda: b"after" in service.payloads(), "message after the drop")
    finally:
        device.close()
    assert not any("another client" in line for line in lines.lines)  # one drop is no takeover


@pytest.mark.broker
@pytest.mark.slow
def test_a_second_client_with_the_same_id_is_told_as_a_likely_takeover(mosquitto):
    # Each connection drops the other's; each link reconnects after 1 s and so drops the
    # other again. Three quick drops in a row are told, once, on both sides.
    twins = []
    logs = []
    for name in ("a", "b"):
        logger = logging.getLogger(f"tests.mqtt_link.twin-{name}")
        logger.setLevel(logging.INFO)
        logs.append(Lines(logger))
        logger.addHandler(logs[-1])
        twins.append(link(Service(), logs[-1], address=mosquitto.address, client_id="link-twin"))
    try:
        for twin in twins:
            twin.start()
        for said in logs:
            (line,) = said.wait("is another client connected as 'link-twin'?", timeout=60)
            assert "3 connections in a row within 10 s" in line.getMessage()
    finally:
        for twin, said in zip(twins, logs, strict=True):
            twin.close()
            said.logger.removeHandler(said)


@pytest.mark.slow
def test_the_first_retry_comes_after_the_wait_the_link_logged(lines):
    # After a failed first attempt paho's own thread waited its delay twice (1 s, then
    # 2 s): a service that logged "reconnecting in 1 s" tried again after 3. The link
    # makes the first attempt itself, and says why it failed.
    device = link(Service(), lines)
    device.start()
    try:
        first, second = lines.wait("cannot reach the broker", count=2, timeout=30)
    finally:
        device.close()
    assert 0.9 < second.created - first.created < 2.5
    why = f"cannot reach the broker at 127.0.0.1:{device.settings.port} (Connection refused)"
    assert first.getMessage() == second.getMessage() == f"{why}; reconnecting in 1 s"
