"""A client's retained presence: online, or offline as its MQTT Last Will."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from protocol import fields as f
from protocol.errors import FieldError
from protocol.ids import validate_id
from protocol.limits import MAX_ID_LENGTH, PROTOCOL_VERSION, SUPPORTED_VERSIONS
from protocol.message_base import WireMessage, check_wire_version, freeze


class AgentState(str, Enum):
    ONLINE = "online"
    OFFLINE = "offline"


#: The ``reason`` of the online status a device publishes once it has handled the final
#: announcement of a fleet with ``max_rounds``: nothing more will come from it.
FINISHED = "finished"
#: The start of a device's ``reason`` while it refuses the fleet's announcements as not
#: signed by the coordinator key it pinned: a coordinator restarted with another key
#: learns it from its devices' statuses (coordinator/rounds/presence.py).
BAD_COORDINATOR_SIGNATURE = "bad_coordinator_signature"
#: The start of a device's ``reason`` while the fleet's announcements are of a protocol
#: version it does not read: ``unsupported_version: the fleet announces protocol version 4;
#: this device reads 2 and 3``. The coordinator lists such devices in its status.
UNSUPPORTED_VERSION = "unsupported_version"


@dataclass(frozen=True, eq=False)
class Status(WireMessage):
    """A client's retained presence; the offline form is also its MQTT Last Will."""

    KIND: ClassVar[str] = "status"
    VERSIONS: ClassVar[tuple[int, ...]] = SUPPORTED_VERSIONS

    fleet: str
    client: str
    state: AgentState
    version: str
    last_round: int | None = None
    reason: str = ""
    #: The coordinator run the device follows ("" before it has heard one); ``last_round``
    #: counts in it. A coordinator finding devices past its open round in its own run
    #: knows its database was rolled back; on another run, that it was lost or replaced.
    run: str = ""
    #: The protocol version it travels in: a device answers in the version of the
    #: announcement it follows (version 2 has no ``run``).
    wire_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_wire_version(self)
        validate_id(self.fleet, field="fleet")
        validate_id(self.client, field="client")
        try:
            freeze(self, "state", AgentState(self.state))
        except ValueError as exc:
            raise FieldError(f"{self.state!r} is not online or offline", field="state") from exc
        f.text(self.version, field="version", max_length=MAX_ID_LENGTH)
        if self.last_round is not None:
            f.integer(self.last_round, field="last_round")
        f.text(self.reason, field="reason")
        if self.run:
            validate_id(self.run, field="run")
            if self.wire_version < 3:
                raise FieldError("a version 2 status names no run", field="run")

    def _body(self) -> dict[str, Any]:
        body = {
            "fleet": self.fleet,
            "client": self.client,
            "state": self.state.value,
            "version": self.version,
            "last_round": self.last_round,
            "run": self.run,
            "reason": self.reason,
        }
        if self.wire_version < 3:
            del body["run"]
        return body

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Status:
        state = env.take("state")
        if not isinstance(state, str):
            raise FieldError("expected a string", field="state")
        return cls(
            fleet=env.take("fleet"),
            client=env.take("client"),
            state=state,  # type: ignore[arg-type]
            version=env.take("version"),
            last_round=env.take("last_round"),
            run=env.take("run") if env.version >= 3 else "",
            reason=env.take("reason"),
            wire_version=env.version,
        )
