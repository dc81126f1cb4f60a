"""The devices' and the coordinator's three main messages as frozen, self-validating
dataclasses, in one place; the fourth, the coordinator's :class:`~protocol.receipts.Receipt`,
is in :mod:`protocol.receipts`.

Each kind has its own module (:mod:`protocol.update`, :mod:`protocol.announcement`,
:mod:`protocol.status`) over the plumbing they share (:mod:`protocol.message_base`).
Nothing outside the protocol package touches raw msgpack maps: producers build a message
and call ``to_wire()``; consumers call ``from_wire(payload)``, which either returns a valid
message or raises a :class:`~protocol.errors.ProtocolError` naming the field. Every field
is always present on the wire (``nil`` for an absent optional value) so that a missing
field is an error rather than a silent default.
"""

from __future__ import annotations

from protocol.announcement import RoundAnnouncement
from protocol.status import (
    BAD_COORDINATOR_SIGNATURE,
    FINISHED,
    UNSUPPORTED_VERSION,
    AgentState,
    Status,
)
from protocol.update import PrivacyMeta, PrototypeUpdate

__all__ = [
    "BAD_COORDINATOR_SIGNATURE",
    "FINISHED",
    "UNSUPPORTED_VERSION",
    "AgentState",
    "Message",
    "PrivacyMeta",
    "PrototypeUpdate",
    "RoundAnnouncement",
    "Status",
]

Message = PrototypeUpdate | RoundAnnouncement | Status
