"""What became of one update offered to the coordinator or to one of its workers."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.limits import PROTOCOL_VERSION

ACCEPTED = "accepted"


@dataclass(frozen=True)
class Decision:
    """The outcome of offering one payload: ``reason`` is ``accepted`` or why not."""

    reason: str
    round: int | None = None
    client: str | None = None
    #: The SHA-256 of the update stored for (round, client), when one is: what the
    #: device's receipt names (for a duplicate, the digest of the first copy).
    digest: str | None = None
    #: The protocol version the update came in: its receipt is written in it.
    wire_version: int = PROTOCOL_VERSION
    #: The epsilon an accepted update says its device has spent in total (None: it
    #: names none, as without a formal mechanism).
    epsilon: float | None = None

    @property
    def accepted(self) -> bool:
        return self.reason == ACCEPTED
