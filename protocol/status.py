"""A client's retained presence: online, or offline as its MQTT Last Will."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from protocol import fields as f
from protocol.errors import FieldError
from protocol.ids import validate_id
from protocol.limits import MAX_ID_LENGTH
from protocol.message_base import WireMessage, freeze


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


@dataclass(frozen=True, eq=False)
class Status(WireMessage):
    """A client's retained presence; the offline form is also its MQTT Last Will."""

    KIND: ClassVar[str] = "status"

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

    def __post_init__(self) -> None:
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

    def _body(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "client": self.client,
            "state": self.state.value,
            "version": self.version,
            "last_round": self.last_round,
            "run": self.run,
            "reason": self.reason,
        }

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
            run=env.take("run"),
            reason=env.take("reason"),
        )
