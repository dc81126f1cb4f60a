"""The round owner over MQTT (coordinator/tier/owner.py decides; this carries its messages)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from coordinator.service.main_loop import MainLoop
from coordinator.tier.owner import Outgoing, RoundOwner
from coordinator.tier.partial_wire import (
    collect_topic,
    partial_filter,
)
from protocol import RoundAnnouncement, round_topic
from protocol.topics import TopicError, TopicKind, parse_topic, receipt_topic, status_filter
from runtime.mqtt_link import MqttLink, Reconnect

log = logging.getLogger(__name__)


def receipt_filter(fleet: str) -> str:
    """Every device's receipt topic: ``protofleet/v1/<fleet>/receipt/+``."""
    return receipt_topic(fleet, "x").rsplit("/", 1)[0] + "/+"


class OwnerService(MainLoop):
    """The owner over MQTT (3.1.1, a persistent session: receipts and partials sent while it
    reconnects are kept for it): it reads the workers' receipts and partial sums and the
    devices' statuses, and publishes the retained announcement and the collect requests.
    :meth:`run` is the main loop; :meth:`healthy` feeds systemd's watchdog."""

    TICK_S = 1.0
    #: How often counted rejections are written and the online gauge is refreshed.
    FLUSH_S = 5.0

    def __init__(self, *, owner: RoundOwner, exit_when_done: bool = True) -> None:
        super().__init__(exit_when_done=exit_when_done, logger=log)
        self.owner = owner
        self.config = owner.config
        self._announce_due = threading.Event()
        self._flushed = time.monotonic()
        fleet = self.config.fleet
        self._partials = partial_filter(fleet).rstrip("+")
        self.link = MqttLink(
            settings=self.config.mqtt,
            client_id=self.config.coordinator_id,
            # The devices' statuses: who is online, and the rounds they say they answered
            # (a rolled-back database learns from them: coordinator/rounds/cycle.py).
            subscriptions=(receipt_filter(fleet), partial_filter(fleet), status_filter(fleet)),
            on_connected=self._on_connected,
            on_message=self._on_message,
            reconnect=Reconnect(jittered=False, cap_s=5.0),
            stopping=self._stop.is_set,
            logger=log,
        )

    def _on_connected(self) -> None:
        # Republished on every (re)connect: the broker may have lost its retained store.
        self._announce_due.set()
        self._wake.set()

    def _on_message(self, message: Any) -> bool:
        # Nothing may escape into paho's network thread.
        try:
            if message.topic.startswith(self._partials):
                taken = self.owner.take_partial(message.payload)
            else:
                taken = self._device_message(message.topic, message.payload)
        except Exception:
            log.exception("unexpected error handling a message on %s", message.topic)
            return True
        if taken:
            self._wake.set()
        return True

    def _device_message(self, name: str, payload: bytes) -> bool:
        """A receipt a worker sent a device, or a device's status: whether it may make a
        round due."""
        try:
            topic = parse_topic(name)
        except TopicError:
            self.owner.count_rejection("topic")
            return False
        if topic.fleet != self.config.fleet:
            return False
        if topic.kind is TopicKind.STATUS:
            return self.owner.record_status(payload, topic_client=topic.client) is not None
        return self.owner.hear_receipt(payload)

    def _send(self, outgoing: Iterable[Outgoing]) -> None:
        fleet = self.config.fleet
        for message in outgoing:
            if isinstance(message, RoundAnnouncement):
                self.link.publish(round_topic(fleet), message.to_wire(), retain=True)
            else:
                self.link.publish(collect_topic(fleet), message.to_wire())

    def healthy(self) -> bool:
        return self._ticked_within(10 * self.TICK_S)

    # -- the main loop's hooks (coordinator/service/main_loop.py) --------------------------------

    def _final_round(self) -> int | None:
        return self.owner.round if self.owner.done else None

    def _due(self) -> float:
        return float(self.owner.seconds_until_due())

    def _step(self) -> None:
        if self._announce_due.is_set():
            self._announce_due.clear()
            self._send([self.owner.announcement])
        self._send(self.owner.poll())
        if time.monotonic() - self._flushed >= self.FLUSH_S:
            self._flushed = time.monotonic()
            self.owner.flush_rejections()
            self.owner.update_online()

    def _shutdown(self) -> None:
        self._stop.set()
        self.owner.flush_rejections()
        self.link.close(
            last_word=(round_topic(self.config.fleet), self.owner.announcement.to_wire())
        )
