"""Bounds every decoder enforces. Kept in one place so docs/protocol.md can cite them."""

from __future__ import annotations

PROTOCOL_VERSION = 2
TOPIC_ROOT = "protofleet"
TOPIC_VERSION = "v1"

#: Default cap on a raw payload, checked before any decoding work is done.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20

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
