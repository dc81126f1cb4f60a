"""ProtoFleet wire protocol: topics, messages and their strict msgpack encoding.

Depends on numpy and msgpack only (and ``cryptography``, imported lazily, to sign and
check signatures), so any process of the fleet can import it.
"""

from protocol.errors import (
    ArrayError,
    FieldError,
    InvalidId,
    MalformedPayload,
    PayloadTooLarge,
    ProtocolError,
    TopicError,
    UnsupportedVersion,
)
from protocol.ids import is_valid_id, validate_id
from protocol.limits import DEFAULT_MAX_PAYLOAD_BYTES, PROTOCOL_VERSION
from protocol.messages import (
    BAD_COORDINATOR_SIGNATURE,
    FINISHED,
    AgentState,
    Message,
    PrivacyMeta,
    PrototypeUpdate,
    RoundAnnouncement,
    Status,
)
from protocol.topics import (
    Topic,
    TopicKind,
    parse_topic,
    round_topic,
    status_filter,
    status_topic,
    update_filter,
    update_topic,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "PROTOCOL_VERSION",
    "BAD_COORDINATOR_SIGNATURE",
    "FINISHED",
    "AgentState",
    "ArrayError",
    "FieldError",
    "InvalidId",
    "MalformedPayload",
    "Message",
    "PayloadTooLarge",
    "PrivacyMeta",
    "PrototypeUpdate",
    "ProtocolError",
    "RoundAnnouncement",
    "Status",
    "Topic",
    "TopicError",
    "TopicKind",
    "UnsupportedVersion",
    "is_valid_id",
    "parse_topic",
    "round_topic",
    "status_filter",
    "status_topic",
    "update_filter",
    "update_topic",
    "validate_id",
]
