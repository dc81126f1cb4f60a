"""The round owner over MQTT (coordinator/owner.py decides; this carries its messages)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from coordinator.owner import Outgoing, RoundOwner
from coordinator.partial_wire import (
    collect_topic,
    partial_filter,
)
from protocol import RoundAnnouncement, round_topic
from protocol.topics import receipt_topic
from runtime.mqtt_link import MqttLink, Reconnect

log = logging.getLogger(__name__)


def receipt_filter(fleet: str) -> str:
    """Every device's receipt topic: ``protofleet/v1/<fleet>/receipt/+``."""
    return receipt_topic(fleet, "x").rsplit("/", 1)[0] + "/+"


class OwnerService:
    """The owner over MQTT (3.1.1, a persistent session: receipts and partials sent while it
    reconnects are kept for it): it reads the workers' receipts and partial sums and
    publishes the retained announcement and the collect requests. :meth:`run` is the main
    loop; :meth:`healthy` feeds systemd's watchdog."""

    TICK_S = 1.0

    def __init__(self, *, owner: RoundOwner, exit_when_done: bool = True) -> None:
        self.owner = owner
        self.config = owner.config
        self.exit_when_done = exit_when_done
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._announce_due = threading.Event()
        self._last_tick: float | None = None
        fleet = self.config.fleet
        self._partials = partial_filter(fleet).rstrip("+")
        self.link = MqttLink(
            settings=self.config.mqtt,
            client_id=self.config.coordinator_id,
            subscriptions=(receipt_filter(fleet), partial_filter(fleet)),
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
                taken = self.owner.hear_receipt(message.payload)
        except Exception:
            log.exception("unexpected error handling a message on %s", message.topic)
            return True
        if taken:
            self._wake.set()
        return True

    def _send(self, outgoing: Iterable[Outgoing]) -> None:
        fleet = self.config.fleet
        for message in outgoing:
            if isinstance(message, RoundAnnouncement):
                self.link.publish(round_topic(fleet), message.to_wire(), retain=True)
            else:
                self.link.publish(collect_topic(fleet), message.to_wire())

    def healthy(self) -> bool:
        if self._last_tick is None:
            return True
        return time.monotonic() - self._last_tick < 10 * self.TICK_S and self.link.healthy()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self, *, ready: threading.Event | None = None) -> None:
        self.link.start()
        self._last_tick = time.monotonic()
        try:
            if ready is not None:
                self.link.wait_connected()
                ready.set()
            while not self._stop.is_set():
                if self.owner.done and self.exit_when_done:
                    log.info("final round %d announced (max_rounds reached); exiting",
                             self.owner.round)  # fmt: skip
                    break
                self._wake.wait(timeout=min(self.owner.seconds_until_due(), self.TICK_S) + 0.01)
                self._wake.clear()
                self._last_tick = time.monotonic()
                if self._announce_due.is_set():
                    self._announce_due.clear()
                    self._send([self.owner.announcement])
                self._send(self.owner.poll())
        finally:
            self._stop.set()
            self.link.close(
                last_word=(round_topic(self.config.fleet), self.owner.announcement.to_wire())
            )
