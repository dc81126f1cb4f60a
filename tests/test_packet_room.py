"""A payload at the services' cap passes the shipped broker: its max_packet_size counts the
whole MQTT packet, so it leaves room for the header, topic and properties around a payload
of DEFAULT_MAX_PAYLOAD_BYTES (protocol/limits.py)."""

from __future__ import annotations

from protocol.limits import BROKER_MAX_PACKET_SIZE, DEFAULT_MAX_PAYLOAD_BYTES
from protocol.topics import update_topic
from tests.mqtt_helpers import connected


def test_the_broker_limit_leaves_room_for_the_packet():
    assert BROKER_MAX_PACKET_SIZE - DEFAULT_MAX_PAYLOAD_BYTES >= 1024


def test_a_payload_at_the_cap_is_delivered_by_the_shipped_broker(mosquitto):
    # The longest topic a device publishes on: fleet and client ids of 64 characters.
    topic = update_topic("f" * 64, "c" * 64)
    payload = bytes(range(256)) * (DEFAULT_MAX_PAYLOAD_BYTES // 256)
    assert len(payload) == DEFAULT_MAX_PAYLOAD_BYTES
    with connected(mosquitto.address, "reader", subscribe=(topic,)) as (_, inbox):
        with connected(mosquitto.address, "c" * 64) as (device, _):
            device.publish(topic, payload, qos=1).wait_for_publish(timeout=30)
        (message,) = inbox.wait(1, timeout=30)
    assert message.payload == payload
