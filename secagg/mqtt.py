"""Secure aggregation over MQTT: the coordinator's and a device's side of one round, each
on a :class:`runtime.mqtt_link.MqttLink` of its own.

A device sends every stage message on its ``secagg/up/<client>`` topic; the coordinator
answers each device on its ``secagg/down/<client>`` topic (:mod:`protocol.topics`), and
relays there the key shares the device's neighbours sealed for it. Messages are signed and
checked by :mod:`secagg.wire`.

- **Threads.** paho's network thread only files each payload in a queue; decoding,
  signature checks and the protocol's own crypto run elsewhere: the coordinator's on the
  thread that calls :meth:`SecAggCoordinatorLink.run`, a device's on a worker thread of its
  own. The link keeps reading (and answering keepalives) while a stage computes, and
  nothing a hostile payload does can raise into paho's thread.
- **Acknowledgement** on receipt, not after handling (no ``manual_ack``): the round lives in
  memory only, so a message redelivered after a restart would find no round to join.
- **Deadlines.** The coordinator opens a stage by publishing its requests and closes it
  when every device it asked has answered, or when the stage's deadline
  (:class:`StageDeadlines`, set by the caller) passes, whichever comes first; whoever has
  not answered by then has dropped. It waits on its queue, never sleeps. A round with
  fewer than ``t`` devices left aborts, and every device that advertised keys (and every
  device the caller expected) is sent an :class:`~secagg.messages.Abort` with the
  reason.
- **Closing.** Once the sum is unmasked, every device that advertised is sent a
  :class:`~secagg.messages.Close` saying whether its input is in it, and the broker has
  taken them (or ``FLUSH_S`` passed) before :meth:`SecAggCoordinatorLink.run` returns:
  the caller announces the next round after that. A device the server excludes at the
  first stage is told why in an abort of its own.
- **Joining.** A device advertises its keys once its link is first up. The coordinator must
  be listening by then: it is the caller's to start it first (later, the round
  announcement will say when).
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt

from protocol.errors import TopicError
from protocol.topics import (
    SecAggDirection,
    parse_secagg_topic,
    secagg_down_topic,
    secagg_up_filter,
)
from runtime.mqtt_link import MqttLink, Reconnect
from runtime.transport import MqttSettings, wait_acknowledged
from secagg.consistency import Consistency
from secagg.errors import Excluded, Refused, RoundAborted
from secagg.messages import (
    Abort,
    Advertise,
    MaskedInput,
    SecAggMessage,
    ShareKeys,
    Stage,
    Unmask,
)
from secagg.server import SecAggResult, SecAggServer
from secagg.wire import CoordinatorWire

log = logging.getLogger(__name__)

#: The most seconds a link waits for the broker to take its last publications before it
#: disconnects (the abort notices, a device's last answer).
FLUSH_S = 5.0

#: The most dropped devices a stage's log line names.
_NAMED = 10

#: The device message that answers each stage.
ANSWERS: Mapping[type[SecAggMessage], Stage] = {
    Advertise: Stage.ADVERTISE,
    ShareKeys: Stage.SHARE,
    MaskedInput: Stage.MASKED_INPUT,
    Consistency: Stage.CONSISTENCY,
    Unmask: Stage.UNMASK,
}


@dataclass(frozen=True, kw_only=True)
class StageDeadlines:
    """Seconds each stage stays open at most, from the moment it opens (the previous
    stage's answers published; the round's start for ``advertise``)."""

    advertise: float
    share: float
    masked_input: float
    consistency: float
    unmask: float

    def __post_init__(self) -> None:
        for stage in Stage:
            seconds = getattr(self, stage.value)
            if type(seconds) not in (int, float) or not 0 < seconds < math.inf:
                raise ValueError(f"the {stage.value} deadline must be positive, got {seconds!r}")

    def of(self, stage: Stage) -> float:
        # The fields are named after the stages' wire names.
        return float(getattr(self, stage.value))


class SecAggCoordinatorLink:
    """Runs ``server``'s round over MQTT (module text): :meth:`run` returns the decoded sum
    of the survivors' inputs, or raises :class:`~secagg.errors.RoundAborted` once
    every device has been told.

    ``expected``: the devices invited, whose advertisements close the first stage early
    (None: it stays open until its deadline). The link holds no input: what arrives is
    handed to ``server``, which adds the masked inputs into one masked sum; ``drops``
    counts what was dropped, by reason, and logs no payload.
    """

    def __init__(
        self,
        *,
        server: SecAggServer,
        wire: CoordinatorWire,
        mqtt_settings: MqttSettings,
        client_id: str,
        deadlines: StageDeadlines,
        expected: Collection[str] | None = None,
        logger: logging.Logger = log,
        on_stage: Callable[[Stage], None] | None = None,
    ) -> None:
        if wire.fleet != server.fleet:
            raise ValueError(f"the wire is for fleet {wire.fleet}, the round for {server.fleet}")
        self.server = server
        self.wire = wire
        self.drops = wire.drops
        self.deadlines = deadlines
        self.expected = None if expected is None else frozenset(expected)
        self._log = logger
        self._on_stage = on_stage  # told as each stage opens (the coordinator's metrics)
        self._inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._takers: dict[type[SecAggMessage], Callable[[Any], None]] = {
            Advertise: server.take_advertise,
            ShareKeys: server.take_share,
            MaskedInput: server.take_masked_input,
            Consistency: server.take_consistency,
            Unmask: server.take_unmask,
        }
        self._ran = False
        # Devices the server excluded: they have answered, and will not again.
        self._excluded: set[str] = set()
        self.link = MqttLink(
            settings=mqtt_settings,
            client_id=client_id,
            subscriptions=(secagg_up_filter(server.fleet),),
            on_connected=lambda: None,
            on_message=self._received,
            # One client, as the coordinator's own link: paho's doubling, capped short, so
            # that a broker back within a stage's deadline still sees the stage through.
            reconnect=Reconnect(jittered=False, cap_s=5.0),
            logger=logger,
        )

    def __enter__(self) -> SecAggCoordinatorLink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.link.start()

    def close(self) -> None:
        self.link.close()

    def run(self) -> SecAggResult:
        """The round's five stages; once only."""
        if self._ran:
            raise RuntimeError(f"round {self.server.round} has run already")
        self._ran = True
        server = self.server
        try:
            self._collect(Stage.ADVERTISE, self.expected)
            rosters = server.close_advertise()
            self._stage_closed(Stage.ADVERTISE, len(rosters))
            self._send(rosters)
            self._collect(Stage.SHARE, frozenset(rosters))
            relayed = server.close_share()
            self._stage_closed(Stage.SHARE, len(relayed))
            self._send(relayed)
            self._collect(Stage.MASKED_INPUT, frozenset(relayed))
            survivors = server.close_masked_input()
            self._stage_closed(Stage.MASKED_INPUT, len(survivors))
            self._send(survivors)
            self._collect(Stage.CONSISTENCY, frozenset(survivors))
            signatures = server.close_consistency()
            self._stage_closed(Stage.CONSISTENCY, len(signatures))
            self._send(signatures)
            self._collect(Stage.UNMASK, frozenset(signatures))
            result = server.close_unmask()
        except RoundAborted as exc:
            self._abort(exc)
            raise
        self._log.info(
            "secure aggregation round %d of %s: the sum of %d devices' inputs is unmasked",
            server.round,
            server.fleet,
            len(result.survivors),
        )
        # Before the caller announces the next round: a device marks its data summed
        # from its close, which it waits for once that announcement reaches it.
        self._send_flushed(server.close_messages())
        return result

    # -- paho's network thread: file the payload, nothing more -------------------------

    def _received(self, message: mqtt.MQTTMessage) -> bool:
        try:
            topic = parse_secagg_topic(message.topic)
        except TopicError:
            self.drops.add("topic", f"a message on {message.topic!r}")
            return True
        if topic.direction is not SecAggDirection.UP or topic.fleet != self.server.fleet:
            self.drops.add("topic", f"a message on {message.topic!r}")
            return True
        self._inbox.put((topic.client, bytes(message.payload)))
        return True

    # -- the caller's thread ------------------------------------------------------------

    def _collect(self, stage: Stage, expected: frozenset[str] | None) -> None:
        """Hand the server what arrives until every one of ``expected`` has answered
        ``stage`` or its deadline passes."""
        if self._on_stage is not None:
            self._on_stage(stage)
        deadline = time.monotonic() + self.deadlines.of(stage)
        answered: set[str] = set()
        while expected is None or not expected <= answered | self._excluded:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                sender, payload = self._inbox.get(timeout=remaining)
            except queue.Empty:
                return
            taken = self._take(sender, payload)
            if taken is not None and ANSWERS[type(taken)] is stage:
                answered.add(taken.client)

    def _take(self, sender: str, payload: bytes) -> SecAggMessage | None:
        message = self.wire.decode(payload, sender=sender)
        if message is None:
            return None
        try:
            self._takers[type(message)](message)
        except Excluded as exc:
            # Dropped, and its sender told why: a device that cannot take part at all
            # (the wrong table, an unusable key) must learn it from its own log.
            self.drops.add("excluded", f"a {message.KIND} of {sender}: {exc}")
            self._excluded.add(sender)
            server = self.server
            notice = Abort(fleet=server.fleet, round=server.round, client=sender,
                           stage=Stage.ADVERTISE, reason=f"this device is refused: {exc.why}",
                           holds=exc.holds)  # fmt: skip
            self._send({sender: notice})
            return None
        except Refused as exc:
            self.drops.add("refused", f"a {message.KIND} of {sender}: {exc}")
            return None
        return message

    def _send(self, messages: Mapping[str, SecAggMessage]) -> list[mqtt.MQTTMessageInfo]:
        fleet = self.server.fleet
        return [
            self.link.publish(secagg_down_topic(fleet, client), self.wire.encode(message))
            for client, message in messages.items()
        ]

    def _stage_closed(self, stage: Stage, answered: int) -> None:
        dropped = self.server.dropped.get(stage, ())
        named = ", ".join(dropped[:_NAMED]) + (", ..." if len(dropped) > _NAMED else "")
        self._log.info(
            "secure aggregation round %d: %s closed, %d devices in%s",
            self.server.round,
            stage.value,
            answered,
            f", {len(dropped)} dropped ({named})" if dropped else "",
        )

    def _abort(self, exc: RoundAborted) -> None:
        notices: dict[str, SecAggMessage] = dict(self.server.abort_messages())
        stage, why = Stage(exc.stage), exc.why
        server = self.server
        for client in sorted((self.expected or frozenset()) - set(notices)):
            notices[client] = Abort(
                fleet=server.fleet, round=server.round, client=client, stage=stage, reason=why
            )
        self._log.warning(
            "secure aggregation round %d of %s aborted at %s: %s; telling %d devices",
            server.round,
            server.fleet,
            stage.value,
            why,
            len(notices),
        )
        self._send_flushed(notices)

    def _send_flushed(self, messages: Mapping[str, SecAggMessage]) -> None:
        """Send ``messages`` and wait (up to ``FLUSH_S`` in all) for the broker to take
        them: the round's last word must be out before the caller moves on."""
        deadline = time.monotonic() + FLUSH_S
        for info in self._send(messages):
            remaining = max(0.0, deadline - time.monotonic())
            wait_acknowledged(
                info, timeout=remaining, stopping=lambda: not self.link.is_connected()
            )
