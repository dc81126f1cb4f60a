"""The coordinator as an MQTT service: paho on one side, the round manager on the other."""

from __future__ import annotations

import contextlib
import logging
import math
import sqlite3
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from coordinator.rounds import Decision, RoundManager
from coordinator.store import StorageFault
from protocol import (
    RoundAnnouncement,
    TopicError,
    TopicKind,
    parse_topic,
    round_topic,
    status_filter,
    update_filter,
)
from protocol.receipts import Receipt, payload_digest
from protocol.topics import receipt_topic
from runtime.mqtt_link import MqttLink, Reconnect

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

log = logging.getLogger(__name__)

#: The longest wait between two attempts to reach the broker again.
RECONNECT_MAX_S = 5.0


class CoordinatorService:
    """Subscribes to updates and statuses, publishes retained round announcements.

    paho delivers messages on its network thread; the accept decision (including the
    SQLite commit) happens there before the link acknowledges the QoS 1 PUBLISH, so an update
    the broker considers delivered is always durable. Round closing runs on the caller's
    thread in :meth:`run`, woken by new updates or by the round's due time.
    """

    TICK_S = 5.0  # the main loop wakes at least this often, round due or not
    FLUSH_S = 5.0  # rejections counted in memory reach the database and log this often
    REASSERT_S = 1.0  # the soonest the announcement is republished over a foreign one

    def __init__(self, *, manager: RoundManager, exit_when_done: bool = True) -> None:
        self.manager = manager
        self.config = manager.config
        self.exit_when_done = exit_when_done
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_tick: float | None = None
        self._fault: BaseException | None = None
        self._flushed = time.monotonic()
        # Digests of the announcements this coordinator published lately, to tell its own
        # retained message from anything else published on the round topic.
        self._own: deque[str] = deque(maxlen=4)
        self._reasserted = -math.inf
        fleet = self.config.fleet
        self.link = MqttLink(
            settings=self.config.mqtt,
            client_id=self.config.coordinator_id,
            subscriptions=(update_filter(fleet), status_filter(fleet), round_topic(fleet)),
            on_connected=self._on_connected,
            on_message=self._on_message,
            # A message is acknowledged once handled: one that could not be stored (a full
            # disk) stays unacknowledged and the broker delivers it again after the restart.
            manual_ack=True,
            # paho doubles its reconnect delay up to the maximum: after a long broker outage
            # a coordinator came back up to a minute after the broker. It is one client;
            # trying every few seconds costs a broker nothing, and rounds resume within
            # that time.
            reconnect=Reconnect(jittered=False, cap_s=RECONNECT_MAX_S),
            stopping=self._stop.is_set,
            logger=log,
        )

    # -- the link's events (paho's network thread) -------------------------------------

    def _on_connected(self) -> None:
        # Republish on every (re)connect: the broker may have lost its retained store.
        self._publish(self.manager.announcement)
        log.info(
            "connected to %s:%d; round %d announced",
            self.config.mqtt.host,
            self.config.mqtt.port,
            self.manager.round,
        )

    def _on_message(self, message: mqtt.MQTTMessage) -> bool:
        """Whether ``message`` is handled (an update stored, or judged and refused): only
        then does the link acknowledge it."""
        # Nothing may escape into paho's network thread: an exception there ends the
        # thread, and with it every reconnect, leaving a coordinator up but deaf.
        if self._fault is not None:
            return False  # intake has stopped; unacknowledged, so delivered again later
        try:
            self._handle(message)
        except (sqlite3.Error, OSError) as exc:
            self._stop_intake(exc)
            return False
        except Exception as exc:
            log.exception("unexpected error handling a message on %s", message.topic)
            self._stop_intake(exc)
            return False
        return True

    def _stop_intake(self, exc: BaseException) -> None:
        self._fault = exc
        self.manager.metrics.storage_errors.inc()
        self._wake.set()

    def _handle(self, message: mqtt.MQTTMessage) -> None:
        try:
            topic = parse_topic(message.topic)
        except TopicError:
            self.manager.count_rejection("topic")
            return
        if topic.fleet != self.config.fleet:
            return
        if topic.kind is TopicKind.UPDATE:
            decision = self.manager.offer(message.payload, topic_client=topic.client)
            # The receipt is queued before the main loop is woken: woken first, it could
            # close the round and publish the next announcement ahead of the receipt, and
            # the device would hear its round closed before hearing its update stored.
            if decision.digest is not None:
                self._send_receipt(decision)
            if decision.accepted:
                self._wake.set()
        elif topic.kind is TopicKind.STATUS:
            self.manager.record_status(message.payload, topic_client=topic.client)
        elif topic.kind is TopicKind.ROUND:
            self._check_round_topic(message.payload)

    def _check_round_topic(self, payload: bytes | bytearray) -> None:
        """Put this coordinator's announcement back when anything else is retained on the
        round topic (a forged announcement, a cleared message): a device that connects
        gets the retained message first. The broker's ACL keeps devices off this topic;
        this is for a broker without one."""
        if payload_digest(payload) in self._own:
            return
        self.manager.count_foreign_announcement()
        now = time.monotonic()
        if now - self._reasserted >= self.REASSERT_S:
            self._reasserted = now
            self._publish(self.manager.announcement)

    def _send_receipt(self, decision: Decision) -> None:
        """Tell the device its update is stored (a duplicate gets the same answer): it
        re-sends until it hears this, since the broker's PUBACK does not mean stored."""
        assert decision.round is not None and decision.client is not None
        assert decision.digest is not None
        receipt = self.manager.sign(
            Receipt(
                fleet=self.config.fleet,
                round=decision.round,
                client=decision.client,
                digest=decision.digest,
            )
        )
        self.link.publish(receipt_topic(self.config.fleet, decision.client), receipt.to_wire())

    # -- driver ------------------------------------------------------------------------

    def _publish(self, announcement: RoundAnnouncement) -> None:
        payload = announcement.to_wire()
        self._own.append(payload_digest(payload))
        self.link.publish(round_topic(self.config.fleet), payload, retain=True)

    def healthy(self) -> bool:
        """For the systemd watchdog: the main loop has ticked recently and paho's network
        thread is alive (its death would mean no reconnects, ever)."""
        if self._last_tick is None:
            return True
        recent = time.monotonic() - self._last_tick < 4 * self.TICK_S
        return recent and self.link.healthy()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self, *, ready: threading.Event | None = None) -> None:
        """Serve until :meth:`stop` (or, with ``exit_when_done``, the final round)."""
        self.link.start()
        self._last_tick = time.monotonic()
        try:
            if ready is not None:
                self.link.wait_connected()
                ready.set()
            while not self._stop.is_set():
                if self.manager.done and self.exit_when_done:
                    log.info(
                        "final round %d announced (max_rounds reached); exiting",
                        self.manager.round,
                    )
                    break
                self._wake.wait(timeout=min(self.manager.seconds_until_due(), self.TICK_S) + 0.01)
                self._wake.clear()
                self._last_tick = time.monotonic()
                self._step()
        finally:
            self._shutdown()

    def _step(self) -> None:
        """One turn of the main loop; a storage error anywhere stops the service."""
        try:
            if self._fault is not None:
                raise self._fault
            announcement = self.manager.poll()
            if announcement is not None:
                self._publish(announcement)
            if time.monotonic() - self._flushed >= self.FLUSH_S:
                self._flushed = time.monotonic()
                self.manager.flush_rejections()
                self.manager.update_online()
        except (sqlite3.Error, OSError) as exc:
            self.manager.metrics.storage_errors.inc()
            raise StorageFault(exc) from exc

    def _shutdown(self) -> None:
        # Our own disconnect below is not a lost connection to warn about.
        self._stop.set()
        if self._fault is None:
            with contextlib.suppress(sqlite3.Error, OSError):  # already stopping for it
                self.manager.flush_rejections()
        # Let the last retained announcement reach the broker before disconnecting.
        self.link.close(
            last_word=(round_topic(self.config.fleet), self.manager.announcement.to_wire())
        )
