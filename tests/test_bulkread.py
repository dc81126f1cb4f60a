"""The bulk-reading paho client every service uses (``runtime/bulkread.py``), against a
real Mosquitto."""

from __future__ import annotations

import threading

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from fleet.transports.broker import MosquittoBroker
from runtime import bulkread
from runtime.bulkread import READ_BYTES, BulkReadClient, split_packet
from runtime.mqtt_client import make_client
from runtime.transport import MqttSettings
from tests.mqtt_helpers import Collector, connected


def test_split_packet_reads_the_fixed_header_by_hand():
    # PUBACK for message id 7: type 0x40, remaining length 2.
    assert split_packet(b"\x40\x02\x00\x07", 0) == (0x40, 2, 4)
    assert split_packet(b"\x40\x02\x00", 0) is None  # body cut off
    assert split_packet(b"\x40", 0) is None  # length not yet here
    # 321 = 0x41 + 2 * 128: remaining length bytes 0xC1 0x02, body starts at 3.
    body = bytes(321)
    assert split_packet(b"\x30\xc1\x02" + body, 0) == (0x30, 3, 324)
    assert split_packet(b"\x30\xc1", 0) is None  # the length's second byte is missing
    # The second packet of a buffer, found from its offset.
    two = b"\xd0\x00" + b"\x40\x02\x00\x09"  # PINGRESP, then a PUBACK
    assert split_packet(two, 0) == (0xD0, 2, 2)
    assert split_packet(two, 2) == (0x40, 4, 6)
    with pytest.raises(ValueError, match="remaining length"):
        split_packet(b"\x30\xff\xff\xff\xff\x01", 0)


def _subscriber(broker: MosquittoBroker, client_id: str, *, manual_ack: bool) -> mqtt.Client:
    client = make_client(
        MqttSettings(host=broker.address.host, port=broker.address.port), client_id,
        manual_ack=manual_ack,
    )  # fmt: skip
    assert isinstance(client, BulkReadClient)
    return client


def _run(client: mqtt.Client, broker: MosquittoBroker, topic: str) -> threading.Event:
    subscribed = threading.Event()
    client.on_subscribe = lambda *_: subscribed.set()
    client.on_connect = lambda c, *_: c.subscribe(topic, qos=1)
    client.connect(broker.address.host, broker.address.port)
    client.loop_start()
    assert subscribed.wait(10)
    return subscribed


def test_every_message_arrives_whole_and_in_order_across_reads(mosquitto):
    # Sizes from one byte to several reads' worth: packets straddle recv() boundaries.
    rng = np.random.default_rng(3)
    sizes = [1, 0, 127, 128, 16_383, 16_384, 3 * READ_BYTES + 17, *rng.integers(1, 900, 300)]
    payloads = [rng.bytes(int(n)) for n in sizes]
    got = Collector()
    client = _subscriber(mosquitto, "bulk-order", manual_ack=False)
    client.on_message = got.on_message
    _run(client, mosquitto, "t/bulk/#")
    try:
        with connected(mosquitto.address, "bulk-pub") as (pub, _):
            for i, payload in enumerate(payloads):
                pub.publish(f"t/bulk/{i % 3}", payload, qos=1)
            got.wait(len(payloads), timeout=30)
            pub.publish("t/bulk/kept", b"last", qos=0, retain=True)
            messages = got.wait(len(payloads) + 1, timeout=30)
    finally:
        client.loop_stop()
        client.disconnect()
    assert [m.payload for m in messages] == [*payloads, b"last"]
    assert [m.topic for m in messages[:4]] == ["t/bulk/0", "t/bulk/1", "t/bulk/2", "t/bulk/0"]
    assert {m.qos for m in messages[:-1]} == {1} and messages[-1].qos == 0
    assert messages[-1].topic == "t/bulk/kept" and not messages[-1].retain  # live, not replayed


@pytest.mark.slow
def test_acknowledged_messages_are_gone_and_unacknowledged_ones_come_again(mosquitto):
    # manual_ack: the coordinator acknowledges only what it stored. A batch's PUBACKs
    # go out together; a message left unacknowledged is delivered again after a reconnect.
    first = Collector()
    client = _subscriber(mosquitto, "bulk-ack", manual_ack=True)

    def on_message(c: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        if message.payload != b"keep-me":
            c.ack(message.mid, message.qos)
        first.on_message(c, userdata, message)

    client.on_message = on_message
    _run(client, mosquitto, "t/ack")
    payloads = [b"a%d" % i for i in range(500)] + [b"keep-me"]
    with connected(mosquitto.address, "bulk-ack-pub") as (pub, _):
        for payload in payloads:
            pub.publish("t/ack", payload, qos=1)
        first.wait(len(payloads), timeout=30)
        pub.publish("t/ack", b"after", qos=1).wait_for_publish(10)
        first.wait(len(payloads) + 1, timeout=30)
    client.disconnect()
    client.loop_stop()
    again = Collector()
    client = _subscriber(mosquitto, "bulk-ack", manual_ack=True)
    client.on_message = again.on_message
    client.connect(mosquitto.address.host, mosquitto.address.port)
    client.loop_start()
    try:
        redelivered = again.wait(1, timeout=10)
        with connected(mosquitto.address, "bulk-ack-pub2") as (pub, _):
            pub.publish("t/ack", b"marker", qos=1)  # everything queued comes before it
            redelivered = again.wait(2, timeout=10)
    finally:
        client.loop_stop()
        client.disconnect()
    assert [m.payload for m in redelivered] == [b"keep-me", b"marker"]
    assert redelivered[0].dup


def test_a_paho_without_the_members_it_needs_gets_paho_s_own_client(monkeypatch, caplog):
    assert bulkread.supported()
    assert bulkread.client_class() is BulkReadClient
    bulkread.supported.cache_clear()
    monkeypatch.delattr(mqtt.Client, "_handle_on_message")
    try:
        assert bulkread.client_class() is mqtt.Client
        assert "lacks _handle_on_message" in caplog.text
    finally:
        monkeypatch.undo()
        bulkread.supported.cache_clear()
    assert bulkread.client_class() is BulkReadClient
