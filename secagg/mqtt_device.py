"""A device's side of a secure-aggregation round over MQTT (secagg/mqtt.py has the
coordinator's): the device's state machine (secagg/device.py) answers each stage
the coordinator opens, on a link and thread of its own beside the agent's service."""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable

import numpy as np
import paho.mqtt.client as mqtt

from protocol.topics import (
    secagg_down_topic,
    secagg_up_topic,
)
from runtime.mqtt_link import MqttLink, Reconnect
from runtime.transport import MqttSettings, wait_acknowledged
from secagg.consistency import Signatures, Survivors
from secagg.device import SecAggDevice
from secagg.errors import Refused
from secagg.messages import (
    Abort,
    Close,
    MaskedInput,
    RelayedShares,
    Roster,
    SecAggMessage,
    Stage,
)
from secagg.mqtt import ANSWERS, FLUSH_S
from secagg.wire import DeviceWire

log = logging.getLogger(__name__)


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
    abort, :meth:`wait_settled` for the coordinator's close or abort; ``drops`` counts
    what was dropped (unchecked, refused by the device, or of another round).
    ``release()`` is called once, before the masked input (the device's noised input)
    is first published, and must return True for it to leave: the caller charges its
    privacy ledger there (None: nothing to charge).
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
        release: Callable[[], bool] | None = None,
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
        self._release = release
        self._released = release is None
        self._log = logger
        self._up_topic = secagg_up_topic(device.fleet, device.client)
        self._inbox: queue.Queue[bytes | _Signal] = queue.Queue()
        self._cond = threading.Condition()
        self._answered: list[Stage] = []
        self._abort: Abort | None = None
        self._close: Close | None = None
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

    @property
    def close_notice(self) -> Close | None:
        """The coordinator's close of the round (whether this device's input is in the
        sum), once one arrived."""
        with self._cond:
            return self._close

    def wait_settled(self, timeout: float | None = None) -> Close | Abort | None:
        """Wait until the coordinator's close or abort of the round arrives; that notice,
        or None if ``timeout`` seconds passed first or the link was closed."""
        with self._cond:
            # A closed link hears nothing more: no use waiting for it.
            self._cond.wait_for(
                lambda: self._closed or self._close is not None or self._abort is not None,
                timeout,
            )
            return self._close or self._abort

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
        if isinstance(message, Abort | Close) and message.round != self.device.round:
            # A notice of another round (a persistent session's leftover) says nothing here.
            self.drops.add("wrong_round", f"a {message.KIND} of round {message.round}")
            return
        if isinstance(message, Close):
            with self._cond:
                self._close = message
                self._cond.notify_all()
            self._log.info(
                "%s: secure aggregation round %d closed; its input is %sin the sum",
                self.device.client,
                message.round,
                "" if message.summed else "not ",
            )
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
            elif isinstance(message, Survivors):
                answer = self.device.consistency(message)
            else:
                assert isinstance(message, Signatures)
                answer = self.device.unmask(message)
        except Refused as exc:
            self.drops.add("refused", f"a {message.KIND} for {self.device.client}: {exc}")
            return
        if isinstance(answer, MaskedInput) and not self._released:
            # The noised input is about to leave: the privacy ledger is charged first
            # (durably), or the device leaves the round having released nothing.
            self._released = self._release is not None and self._release()
            if not self._released:
                self.drops.add("budget", f"a {message.KIND} for {self.device.client}")
                return
        self._publish(answer)

    def _publish(self, answer: SecAggMessage) -> None:
        payload = self.wire.encode(answer)
        info = self.link.publish(self._up_topic, payload)
        stage = ANSWERS[type(answer)]
        with self._cond:
            self._bytes_out += len(payload)
            self._last = info
            if stage not in self._answered:
                self._answered.append(stage)
            self._cond.notify_all()
        if self._on_answered is not None:
            self._on_answered(stage)
