"""Bounds every decoder enforces. Kept in one place so docs/protocol.md can cite them."""

from __future__ import annotations

#: The version this code writes (an announcement may be configured to the previous one
#: while a fleet upgrades: coordinator ``[protocol] announce_version``).
PROTOCOL_VERSION = 3
#: The version before it, which the update, announcement, status and receipt decoders
#: still read, so that a fleet upgrades one side at a time (docs/protocol.md, Versions).
PREVIOUS_VERSION = 2
SUPPORTED_VERSIONS = (PREVIOUS_VERSION, PROTOCOL_VERSION)
TOPIC_ROOT = "protofleet"
TOPIC_VERSION = "v1"

#: Default cap on a raw payload, checked before any decoding work is done. 4 MiB holds the
#: largest message the project sends: FedAvg's and FPL's head weights, FC(K*d_e, 256) in
#: float32, 1.3 MB over EfficientNet-Lite0's 1280 features (prototype updates are about
#: 5 kB; announcements keep to the downlink budget).
DEFAULT_MAX_PAYLOAD_BYTES = 4 << 20
#: Room for the MQTT packet around a payload at the cap: fixed header, topic, packet id
#: and MQTT 5 properties. A broker's ``max_packet_size`` counts the whole packet, so a
#: payload exactly at the cap under a ``max_packet_size`` equal to it got its sender
#: disconnected, again on every reconnect as the client resent it.
MQTT_PACKET_ROOM = 64 << 10
#: The shipped broker's ``max_packet_size`` (systemd/mosquitto/protofleet.conf and the
#: brokers a simulated fleet starts): the payload cap plus the packet's room.
BROKER_MAX_PACKET_SIZE = DEFAULT_MAX_PAYLOAD_BYTES + MQTT_PACKET_ROOM

MAX_ID_LENGTH = 64
MAX_BUNDLE_ID_LENGTH = 128
MAX_METHOD_LENGTH = 32
MAX_GUARANTEE_LENGTH = 64
MAX_TEXT_LENGTH = 256
MAX_CLASSES = 4096
MAX_CLIENTS = 100_000
MAX_ARRAY_NDIM = 4
MAX_EXTRAS = 64
MAX_PARAMS = 64
