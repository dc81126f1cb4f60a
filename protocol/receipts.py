"""The coordinator's receipt for a stored update, sent on the device's own receipt topic.

A broker's PUBACK says only that the broker took a message; a broker can still lose it (a
queue that overflows, a restart without persistence). A device keeps re-sending its update
for the open round until a receipt names it, and a duplicate is answered with the receipt
of what is stored. ``run`` is the coordinator run the update was stored in: a device
takes receipts of the run it follows only. ``digest`` is the SHA-256 of the stored update's payload: a receipt
naming another digest means the coordinator holds someone else's update for this device.

A *refusal* (``refused`` set) answers an update the coordinator will never take from this
device whatever it resends: its certificate is ``revoked`` or it is ``unenrolled``. It names
the refused payload's digest and stores nothing; the device stops resending for the round.
Without it a device cut off while connected re-sent every 10 s, never told why.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar

from protocol import fields as f
from protocol.auth import Auth
from protocol.errors import FieldError
from protocol.ids import validate_id
from protocol.limits import PROTOCOL_VERSION, SUPPORTED_VERSIONS
from protocol.message_base import WireMessage, check_wire_version, legacy_run, take_auth

#: Rejection reasons a device is told of (coordinator/admission.py names them): no resend
#: can change them, only its operator.
REFUSALS = ("revoked", "unenrolled")


def payload_digest(payload: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()


@dataclass(frozen=True, eq=False)
class Receipt(WireMessage):
    KIND: ClassVar[str] = "receipt"
    VERSIONS: ClassVar[tuple[int, ...]] = SUPPORTED_VERSIONS

    fleet: str
    round: int
    run: str
    client: str
    digest: str
    auth: Auth | None = None
    #: Written in the version of the update it answers; version 2 has no ``run`` (read
    #: back as the run its signature names, ``""`` unsigned).
    wire_version: int = PROTOCOL_VERSION
    #: Why the update was refused for good (a reason of :data:`REFUSALS`), "" for a receipt.
    refused: str = ""

    def __post_init__(self) -> None:
        check_wire_version(self)
        validate_id(self.fleet, field="fleet")
        f.integer(self.round, field="round")
        if self.run or self.wire_version >= 3:
            validate_id(self.run, field="run")
        validate_id(self.client, field="client")
        f.text(self.digest, field="digest", max_length=64, empty=False)
        if len(self.digest) != 64 or any(c not in "0123456789abcdef" for c in self.digest):
            raise FieldError("expected 64 lowercase hex digits", field="digest")
        if self.refused and self.refused not in REFUSALS:
            raise FieldError(f"expected one of {', '.join(REFUSALS)}", field="refused")

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "fleet": self.fleet,
            "round": self.round,
            "run": self.run,
            "client": self.client,
            "digest": self.digest,
        }
        if self.wire_version < 3:
            del body["run"]
        # Only when set: a receipt's bytes (and signature) stay what they were.
        if self.refused:
            body["refused"] = self.refused
        return body

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Receipt:
        auth = take_auth(env)
        return cls(
            fleet=env.take("fleet"),
            round=env.take("round"),
            run=env.take("run") if env.version >= 3 else legacy_run(auth),
            client=env.take("client"),
            digest=env.take("digest"),
            auth=auth,
            wire_version=env.version,
            refused=env.take_optional("refused") or "",
        )
