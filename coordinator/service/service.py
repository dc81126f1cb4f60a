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

from coordinator.decision import Decision
from coordinator.rounds import RoundManager
from coordinator.rounds.secure_rounds import SecureRounds
from coordinator.service.main_loop import MainLoop
from coordinator.storage.group_sync import GroupSync
from coordinator.storage.store import StorageFault
from protocol import (
    RoundAnnouncement,
    TopicError,
    TopicKind,
    parse_topic,
    round_topic,
    status_filter,
    update_filter,
)
from protocol.receipts import REFUSALS, Receipt, payload_digest
from protocol.topics import receipt_topic
from runtime.mqtt_link import MqttLink, Reconnect

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

log = logging.getLogger(__name__)

#: The longest wait between two attempts to reach the broker again.
RECONNECT_MAX_S = 5.0


class CoordinatorService(MainLoop):
    """Subscribes to updates and statuses, publishes retained round announcements.

    paho delivers messages on its network thread; the accept decision (including the
    SQLite commit) happens there before the link acknowledges the QoS 1 PUBLISH, so an update
    the broker considers delivered is always durable. Round closing runs on the caller's
    thread in :meth:`run`, woken by new updates or by the round's due time.
    """

    TICK_S = 5.0  # the main loop wakes at least this often, round due or not
    FLUSH_S = 5.0  # rejections counted in memory reach the database and log this often
    REASSERT_S = 1.0  # the soonest the announcement is republished over a foreign one
    ECHO_S = 10.0  # an own publication not heard back within this is taken as lost

    def __init__(self, *, manager: RoundManager, exit_when_done: bool = True) -> None:
        super().__init__(exit_when_done=exit_when_done, logger=log)
        self.manager = manager
        self.config = manager.config
        self._fault: BaseException | None = None
        # sqlite_synchronous = "GROUP": receipts wait for one fsync per batch, and an
        # announcement (a round's close) for one covering it.
        self._sync = (
            GroupSync(manager.store.path, on_error=self._stop_intake)
            if self.config.sqlite_synchronous == "GROUP"
            else None
        )
        self._flushed = time.monotonic()
        self._told: set[tuple[int, str]] = set()  # (round, client) refusals sent
        # What the round topic should hold: the digest of the announcement published last,
        # and those of the publications not yet heard back from the broker (in order), with
        # when each was sent. Anything else that arrives there was retained over it.
        self._round_lock = threading.Lock()
        self._current: str | None = None
        self._echoes: deque[tuple[str, float]] = deque(maxlen=64)
        self._reasserted = -math.inf
        self._reassert_due = False
        self._announce_due = False
        self._overwritten = 0
        # A secure fleet's rounds are closed by their secure-aggregation rounds.
        self.secure = (
            None
            if manager.secure is None
            else SecureRounds(
                config=manager.config, release=manager.secure, run_id=manager.run_id,
                signer=manager.keys.signer, devices=manager.keys.devices,
                deliver=manager.take_secure, wake=self._wake.set, metrics=manager.metrics,
                running=manager.secure_sum,
            )
        )  # fmt: skip
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
        with self._round_lock:
            self._announce_due = True
        self._wake.set()
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
            elif decision.reason in REFUSALS:
                self._send_refusal(decision, message.payload)
            if decision.accepted:
                self._wake.set()
        elif topic.kind is TopicKind.STATUS:
            self.manager.record_status(message.payload, topic_client=topic.client)
        elif topic.kind is TopicKind.ROUND:
            self._check_round_topic(message.payload)

    def _check_round_topic(self, payload: bytes | bytearray) -> None:
        """Put this coordinator's current announcement back when anything else is retained
        on the round topic: a forged announcement, a cleared message, or one of this
        coordinator's own earlier announcements published again (a replay: signed and
        well-formed, it would tell every device that connects later an old round). A device
        that connects gets the retained message first. The broker's ACL keeps devices off
        this topic; this is for a broker without one, or a client that gets past it.

        Only a byte-for-byte copy of the current announcement is left alone. A message
        that our own later publication, still on its way back, will replace is left to it:
        the copy retained before a restart (signed afresh since) is one. Each republication
        waits :attr:`REASSERT_S` after the last, so two coordinators on one topic take
        turns at that pace instead of flooding the broker."""
        digest = payload_digest(payload)
        with self._round_lock:
            if any(d == digest for d, _ in self._echoes):
                while self._echoes.popleft()[0] != digest:
                    pass  # publications the broker took in order: those before it are past
            if digest == self._current or self._announce_due or self._replacing():
                return
            self._overwritten += 1
            count = self._overwritten
            self._reassert_due = True
        self._wake.set()  # the main loop republishes, once REASSERT_S has passed
        self.manager.count_foreign_announcement()
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: a fight stays readable
            log.warning(
                "a message that is not this coordinator's current announcement (round %d) "
                "was retained on %s: foreign, cleared or replayed (%d so far); announcing "
                "round %d again",
                self.manager.round,
                round_topic(self.config.fleet),
                count,
                self.manager.round,
                extra={"event": "announcement_overwritten", "round": self.manager.round},
            )

    def _replacing(self) -> bool:
        """Whether the current announcement is on its way to the broker (published and not
        yet heard back, lately enough not to be lost): it replaces whatever came first.
        So is one about to be published after a (re)connect."""
        now = time.monotonic()
        return any(d == self._current and now - at < self.ECHO_S for d, at in self._echoes)

    def _reassert_wait(self) -> float:
        """Seconds until the announcement is due again on the round topic (inf: it is not)."""
        with self._round_lock:
            if self._announce_due:
                return 0.0
            if not self._reassert_due:
                return math.inf
            return max(0.0, self._reasserted + self.REASSERT_S - time.monotonic())

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
                # The update's version: version 2 has no run (its signature names it).
                run=self.manager.run_id if decision.wire_version >= 3 else "",
                wire_version=decision.wire_version,
            )
        )
        topic, payload = receipt_topic(self.config.fleet, decision.client), receipt.to_wire()
        if self._sync is not None:
            self._sync.after_sync(lambda: self.link.publish(topic, payload))
        else:
            self.link.publish(topic, payload)

    def _send_refusal(self, decision: Decision, payload: bytes | bytearray) -> None:
        """Tell a device its updates are refused for good (revoked, unenrolled), once a
        round: it stops resending, and its log says what its operator must do. Once a
        round, so a flood of updates claiming such devices costs one signature each."""
        assert decision.round is not None and decision.client is not None
        key = (decision.round, decision.client)
        if key in self._told:
            return
        if len(self._told) >= 100_000:  # bounded: a flood of invented ids
            self._told.clear()
        self._told.add(key)
        refusal = self.manager.sign(
            Receipt(
                fleet=self.config.fleet, round=decision.round, run=self.manager.run_id,
                client=decision.client, digest=payload_digest(payload), refused=decision.reason,
            )
        )  # fmt: skip
        self.link.publish(receipt_topic(self.config.fleet, decision.client), refusal.to_wire())

    # -- driver ------------------------------------------------------------------------

    def _publish(self, announcement: RoundAnnouncement) -> None:
        """Retain ``announcement`` on the round topic. Only the main loop publishes there,
        so the broker takes the announcements in the order of :attr:`_echoes`; paho's
        thread asks for it instead (:meth:`_reassert_wait`)."""
        if self.secure is not None and not announcement.params.get("final"):
            # Listening before the devices hear of the round (once per round).
            self.secure.begin(announcement.round)
        if self._sync is not None:
            # The close this announces is durable first, and the receipts queued before
            # it are out before it (a device hears its update stored, then the close).
            self._sync.flush()
        payload = announcement.to_wire()
        digest = payload_digest(payload)
        with self._round_lock:
            self._current = digest
            self._echoes.append((digest, time.monotonic()))
            if self._reassert_due or self._announce_due:
                self._reasserted = time.monotonic()
            self._reassert_due = self._announce_due = False
        # Outside the lock: paho's publish takes its callback lock, which its thread holds
        # while it hands us a message (and waits for this lock in _check_round_topic).
        self.link.publish(round_topic(self.config.fleet), payload, retain=True)

    def healthy(self) -> bool:
        """For the systemd watchdog: the main loop has ticked recently and paho's network
        thread is alive (its death would mean no reconnects, ever)."""
        return self._ticked_within(4 * self.TICK_S)

    # -- the main loop's hooks (coordinator/service/main_loop.py) --------------------------------

    def _final_round(self) -> int | None:
        return self.manager.round if self.manager.done else None

    def _due(self) -> float:
        return min(self.manager.seconds_until_due(), self._reassert_wait())

    def _step(self) -> None:
        """One turn of the main loop; a storage error anywhere stops the service."""
        try:
            if self._fault is not None:
                raise self._fault
            announcement = self.manager.poll()
            if announcement is not None:
                self._publish(announcement)
            elif self._reassert_wait() == 0.0:
                self._publish(self.manager.announcement)
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
        if self.secure is not None:
            self.secure.stop()
        if self._fault is None:
            with contextlib.suppress(sqlite3.Error, OSError):  # already stopping for it
                self.manager.flush_rejections()
        if self._sync is not None:
            self._sync.close()  # the receipts still held go out after a last fsync
        # Let the last retained announcement reach the broker before disconnecting.
        self.link.close(
            last_word=(round_topic(self.config.fleet), self.manager.announcement.to_wire())
        )
