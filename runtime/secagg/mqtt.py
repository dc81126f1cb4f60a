"""Secure aggregation over MQTT: the coordinator's and a device's side of one round, each
on a :class:`runtime.mqtt_link.MqttLink` of its own.

A device sends every stage message on its ``secagg/up/<client>`` topic; the coordinator
answers each device on its ``secagg/down/<client>`` topic (:mod:`protocol.topics`), and
relays there the key shares the device's neighbours sealed for it. Messages are signed and
checked by :mod:`runtime.secagg.wire`.

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
  device the caller expected) is sent an :class:`~runtime.secagg.messages.Abort` with the
  reason.
- **Joining.** A device advertises its keys once its link is first up. The coordinator must
  be listening by then: it is the caller's to start it first (later, the round
  announcement will say when).
"""

from __future__ import annotations

import enum
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt

from protocol.errors import TopicError
from protocol.topics import (
    SecAggDirection,
    parse_secagg_topic,
    secagg_down_topic,
    secagg_up_filter,
    secagg_up_topic,
)
from runtime.mqtt_link import MqttLink, Reconnect
from runtime.secagg.device import SecAggDevice
from runtime.secagg.errors import Refused, RoundAborted
from runtime.secagg.messages import (
    Abort,
    Advertise,
    MaskedInput,
    RelayedShares,
    Roster,
    SecAggMessage,
    ShareKeys,
    Stage,
    Survivors,
    Unmask,
)
from runtime.secagg.server import SecAggResult, SecAggServer
from runtime.secagg.wire import CoordinatorWire, DeviceWire
from runtime.transport import MqttSettings, wait_acknowledged

log = logging.getLogger(__name__)

#: The most seconds a link waits for the broker to take its last publications before it
#: disconnects (the abort notices, a device's last answer).
FLUSH_S = 5.0

#: The most dropped devices a stage's log line names.
_NAMED = 10

#: The device message that answers each stage.
_ANSWERS: Mapping[type[SecAggMessage], Stage] = {
    Advertise: Stage.ADVERTISE,
    ShareKeys: Stage.SHARE,
    MaskedInput: Stage.MASKED_INPUT,
    Unmask: Stage.UNMASK,
}


@dataclass(frozen=True, kw_only=True)
class StageDeadlines:
    """Seconds each stage stays open at most, from the moment it opens (the previous
    stage's answers published; the round's start for ``advertise``)."""

    advertise: float
    share: float
    masked_input: float
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
    of the survivors' inputs, or raises :class:`~runtime.secagg.errors.RoundAborted` once
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
    ) -> None:
        if wire.fleet != server.fleet:
            raise ValueError(f"the wire is for fleet {wire.fleet}, the round for {server.fleet}")
        self.server = server
        self.wire = wire
        self.drops = wire.drops
        self.deadlines = deadlines
        self.expected = None if expected is None else frozenset(expected)
        self._log = logger
        self._inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._takers: dict[type[SecAggMessage], Callable[[Any], None]] = {
            Advertise: server.take_advertise,
            ShareKeys: server.take_share,
            MaskedInput: server.take_masked_input,
            Unmask: server.take_unmask,
        }
        self._ran = False
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
        """The round's four stages; once only."""
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
            self._collect(Stage.UNMASK, frozenset(survivors))
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
        deadline = time.monotonic() + self.deadlines.of(stage)
        answered: set[str] = set()
        while expected is None or not expected <= answered:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                sender, payload = self._inbox.get(timeout=remaining)
            except queue.Empty:
                return
            taken = self._take(sender, payload)
            if taken is not None and _ANSWERS[type(taken)] is stage:
                answered.add(taken.client)

    def _take(self, sender: str, payload: bytes) -> SecAggMessage | None:
        message = self.wire.decode(payload, sender=sender)
        if message is None:
            return None
        try:
            self._takers[type(message)](message)
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
        deadline = time.monotonic() + FLUSH_S
        for info in self._send(notices):
            remaining = max(0.0, deadline - time.monotonic())
            wait_acknowledged(
                info, timeout=remaining, stopping=lambda: not self.link.is_connected()
            )


class _Signal(enum.Enum):
    ADVERTISE = "advertise"
    STOP = "stop"


class SecAggDeviceLink:
    """Runs ``device``'s part of a round over MQTT (module text) with ``vector`` as its
    input: it advertises once its link is first up and answers each coordinator message
    addressed to it on a worker thread, signing what it sends.

    ``on_answered(stage)`` is told on that thread once each answer is published, before
    anything else is handled (:meth:`close` may be called from it: a device leaving the
    round at a chosen point). :meth:`wait_finished` waits for the unmask answer or an
    abort; ``drops`` counts what was dropped (unchecked, or refused by the device).
    """

    def __init__(
        self,
        *,
        device: SecAggDevice,
        vector: np.ndarray,
        wire: DeviceWire,
        mqtt_settings: MqttSettings,
        client_id: str | None = None,
        on_answered: Callable[[Stage], None] | None = None,
        logger: logging.Logger = log,
    ) -> None:
        if (wire.fleet, wire.client) != (device.fleet, device.client):
            raise ValueError(
                f"the wire is for {wire.client} of {wire.fleet}, the device is "
                f"{device.client} of {device.fleet}"
            )
        values = np.asarray(vector, dtype=np.float64)
        if values.shape != (device.settings.length,):
            raise ValueError(f"vector shape {values.shape} is not ({device.settings.length},)")
        self.device = device
        self.wire = wire
        self.drops = wire.drops
        self._vector = values
        self._on_answered = on_answered
        self._log = logger
        self._up_topic = secagg_up_topic(device.fleet, device.client)
        self._inbox: queue.Queue[bytes | _Signal] = queue.Queue()
        self._cond = threading.Condition()
        self._answered: list[Stage] = []
        self._abort: Abort | None = None
        self._advertised = False
        self._closed = False
        self._bytes_out = self._bytes_in = 0
        self._last: mqtt.MQTTMessageInfo | None = None
        self._worker = threading.Thread(
            target=self._work, name=f"secagg-{device.client}", daemon=True
        )
        self.link = MqttLink(
            settings=mqtt_settings,
            client_id=client_id or device.client,
            subscriptions=(secagg_down_topic(device.fleet, device.client),),
            on_connected=self._connected,
            on_message=self._received,
            reconnect=Reconnect(jittered=True),
            logger=logger,
        )

    def __enter__(self) -> SecAggDeviceLink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._worker.start()
        self.link.start()

    def close(self, *, timeout: float = FLUSH_S) -> None:
        """Stop answering, wait (up to ``timeout`` s) for the broker to take the last answer,
        and disconnect. Callable from any thread, ``on_answered`` included."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            last = self._last
            self._cond.notify_all()
        self._inbox.put(_Signal.STOP)
        if last is not None and self.link.is_connected():
            wait_acknowledged(last, timeout=timeout, stopping=lambda: not self.link.is_connected())
        self.link.close()
        if threading.current_thread() is not self._worker and self._worker.is_alive():
            self._worker.join(timeout)

    @property
    def answered(self) -> tuple[Stage, ...]:
        """The stages answered so far, in order."""
        with self._cond:
            return tuple(self._answered)

    @property
    def traffic(self) -> tuple[int, int]:
        """Payload bytes this device has sent and received in the round so far."""
        with self._cond:
            return self._bytes_out, self._bytes_in

    @property
    def abort(self) -> Abort | None:
        """The coordinator's abort notice, once one arrived."""
        with self._cond:
            return self._abort

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Wait until this device has answered the last stage or heard the round abort;
        False if ``timeout`` seconds passed first or the link was closed."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or self._abort is not None or Stage.UNMASK in self._answered,
                timeout,
            ) and (self._abort is not None or Stage.UNMASK in self._answered)

    # -- paho's network thread: queue, nothing more ------------------------------------

    def _connected(self) -> None:
        # The first connection only: after a reconnect paho sends again what the broker
        # had not acknowledged (a persistent session), and the keys are already out.
        if not self._advertised:
            self._advertised = True
            self._inbox.put(_Signal.ADVERTISE)

    def _received(self, message: mqtt.MQTTMessage) -> bool:
        payload = bytes(message.payload)
        with self._cond:
            self._bytes_in += len(payload)
        self._inbox.put(payload)
        return True

    # -- the worker thread --------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._inbox.get()
            with self._cond:
                if self._closed or item is _Signal.STOP:
                    return
            try:
                self._handle(item)
            except Exception:
                # The last resort: a bug here must not end the thread and leave the device
                # deaf for the rest of the round.
                self._log.exception(
                    "%s: unexpected error in a secure aggregation stage", self.device.client
                )

    def _handle(self, item: bytes | _Signal) -> None:
        if item is _Signal.ADVERTISE:
            self._publish(self.device.advertise())
            return
        assert isinstance(item, bytes)
        message = self.wire.decode(item)
        if message is None:
            return
        if isinstance(message, Abort):
            with self._cond:
                self._abort = message
                self._cond.notify_all()
            self._log.warning(
                "%s: secure aggregation round %d aborted at %s: %s",
                self.device.client,
                message.round,
                message.stage.value,
                message.reason,
            )
            return
        try:
            if isinstance(message, Roster):
                answer: SecAggMessage = self.device.share(message)
            elif isinstance(message, RelayedShares):
                answer = self.device.masked_input(message, self._vector)
            else:
                assert isinstance(message, Survivors)
                answer = self.device.unmask(message)
        except Refused as exc:
            self.drops.add("refused", f"a {message.KIND} for {self.device.client}: {exc}")
            return
        self._publish(answer)

    def _publish(self, answer: SecAggMessage) -> None:
        payload = self.wire.encode(answer)
        info = self.link.publish(self._up_topic, payload)
        stage = _ANSWERS[type(answer)]
        with self._cond:
            self._bytes_out += len(payload)
            self._last = info
            if stage not in self._answered:
                self._answered.append(stage)
            self._cond.notify_all()
        if self._on_answered is not None:
            self._on_answered(stage)
