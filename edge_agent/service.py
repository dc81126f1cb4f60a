"""The agent's MQTT loop: presence, announcements in, updates out.

paho runs the network on its own thread (behind :class:`runtime.mqtt_link.MqttLink`);
training runs on the caller's thread so a long round never starves keepalives. Only the
newest announcement is kept: a device that was offline for three rounds answers the
current one, not the backlog.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_agent.screening import IGNORED
from edge_agent.secure_join import SecureJoin
from protocol import (
    FINISHED,
    AgentState,
    ProtocolError,
    RoundAnnouncement,
    Status,
    UnsupportedVersion,
    round_topic,
    status_topic,
    update_topic,
)
from protocol.limits import PROTOCOL_VERSION
from protocol.receipts import Receipt, payload_digest
from protocol.topics import receipt_topic
from runtime.mqtt_link import MqttLink, Reconnect
from runtime.transport import wait_acknowledged
from runtime.version import package_version

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

    # Only named here: the service drives the agent it is handed, so importing it (as
    # `edge-agent --help` does) does not pay for torch, which the agent's module imports.
    from edge_agent.agent import Agent

log = logging.getLogger(__name__)

#: The longest wait between two sends of an update without a receipt ([mqtt] resend_s is
#: the first; each is twice the one before).
RESEND_MAX_S = 120.0


@dataclass
class _Pending:
    """An update published for the open round and not yet named by a receipt."""

    round: int
    run: str | None
    payload: bytes
    digest: str
    resend_at: float
    wait: float


class AgentService:
    def __init__(
        self,
        *,
        agent: Agent,
        publish_timeout: float = 30.0,
        resend_max_s: float = RESEND_MAX_S,
    ) -> None:
        self.agent = agent
        self.cfg = agent.cfg
        self.publish_timeout = publish_timeout
        self.resend_s = agent.cfg.mqtt.resend_s
        self.resend_max_s = max(self.resend_s, resend_max_s)
        self._cond = threading.Condition()
        self._latest: bytes | None = None
        self._receipts: list[bytes] = []  # receipt payloads, handled on the main thread
        self._pending: _Pending | None = None
        self._open_round: int | None = None  # the newest round announced
        # A secure fleet: the round this device is adding its input to, and its link.
        self._secure = SecureJoin(cfg=self.cfg, keys=agent.keys, state=agent.state)
        self._stop = False
        self.malformed = 0
        # The reason of the retained online status, when it says why rounds are ignored.
        self._mismatch_said = ""
        # The protocol version of the newest announcement read: statuses are written in
        # it, so that a coordinator of the previous version reads them through an upgrade.
        self._speaks = PROTOCOL_VERSION
        self._status_topic = status_topic(self.cfg.fleet, self.cfg.agent_id)
        self._receipt_topic = receipt_topic(self.cfg.fleet, self.cfg.agent_id)
        offline = self._status(AgentState.OFFLINE, "connection lost")
        self.link = MqttLink(
            settings=self.cfg.mqtt,
            client_id=self.cfg.agent_id,
            subscriptions=(round_topic(self.cfg.fleet), self._receipt_topic),
            on_connected=self._on_connected,
            on_message=self._on_message,
            # A fleet's devices spread their reconnects after a broker restart.
            reconnect=Reconnect(jittered=True),
            will=(self._status_topic, offline),
            stopping=lambda: self._stop,
            logger=log,
        )

    def _status(self, state: AgentState, reason: str = "") -> bytes:
        return Status(
            fleet=self.cfg.fleet,
            client=self.cfg.agent_id,
            state=state,
            version=package_version(),
            last_round=self.agent.last_round,
            run=(self.agent.run or "") if self._speaks >= 3 else "",
            reason=reason,
            wire_version=self._speaks,
        ).to_wire()

    # -- the link's events (paho's network thread) -------------------------------------

    def _on_connected(self) -> None:
        self._mismatch_said = ""  # said afresh when the retained announcement comes again
        self._say_online("")
        log.info(
            "connected to %s:%d as %s", self.cfg.mqtt.host, self.cfg.mqtt.port, self.cfg.agent_id
        )

    def _on_message(self, message: mqtt.MQTTMessage) -> bool:
        if not message.payload:
            return True  # a cleared retained message
        with self._cond:
            if message.topic == self._receipt_topic:
                if len(self._receipts) < 64:  # a flood of them waits for the main thread
                    self._receipts.append(bytes(message.payload))
            else:
                self._latest = bytes(message.payload)
            self._cond.notify_all()
        return True

    # -- driver ------------------------------------------------------------------------

    def healthy(self) -> bool:
        """For the systemd watchdog: paho's network thread must be alive once started."""
        return self.link.healthy()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _next(self) -> tuple[bytes | None, list[bytes]]:
        """The newest announcement (if one came) and the receipts that came, waiting at
        most until the pending update is due to be sent again."""
        with self._cond:
            pending = self._pending
            timeout = None if pending is None else max(0.0, pending.resend_at - time.monotonic())
            self._cond.wait_for(
                lambda: self._stop or self._latest is not None or bool(self._receipts),
                timeout=timeout,
            )
            payload, self._latest = self._latest, None
            receipts, self._receipts = self._receipts, []
            return payload, receipts

    def run(self) -> None:
        self.link.start()
        try:
            while not self._stop:
                payload, receipts = self._next()
                if self._stop:
                    break
                for receipt in receipts:
                    self._on_receipt(receipt)
                if payload is not None:
                    self._process(payload)
                self._resend_if_due()
        finally:
            self._shutdown()

    # -- receipts ----------------------------------------------------------------------

    def _on_receipt(self, payload: bytes) -> None:
        try:
            receipt = Receipt.from_wire(payload, max_bytes=self.cfg.mqtt.max_payload_bytes)
        except ProtocolError as exc:
            log.warning("ignoring a malformed receipt: %s", exc)
            return
        forged = self.agent.keys.announcement_problem(receipt)
        if forged is not None:
            log.warning("ignoring a receipt for round %d: %s", receipt.round, forged)
            return
        pending = self._pending
        if (
            pending is None
            or receipt.fleet != self.cfg.fleet
            or receipt.client != self.cfg.agent_id
            or receipt.round != pending.round
            or (receipt.wire_version >= 3 and receipt.run != pending.run)
        ):
            return  # a late copy, or one for a round this device has settled
        if receipt.refused:
            if receipt.digest == pending.digest:
                self._refused(pending.round, receipt.refused)
            return
        self._pending = None
        # Settled on disk before it is said: a device killed after the line answers the
        # round's re-announcement with already_answered, not with a re-send.
        self.agent.state.mark_published(pending.round)
        if receipt.digest != pending.digest:
            # Only another client publishing as this device gets here: the coordinator
            # took its update first and keeps it (signed updates prevent this).
            log.error(
                "round %d: the coordinator holds another update from %s than this device "
                "sent (digest %s, ours %s): another client publishes as this device",
                pending.round,
                self.cfg.agent_id,
                receipt.digest[:12],
                pending.digest[:12],
            )
        else:
            self.agent.confirmed(pending.round)
            log.info("round %d: update stored by the coordinator", pending.round)

    def _refused(self, round_: int, reason: str) -> None:
        """The coordinator refuses this device's updates for good: no resend can change
        that, so stop resending this round's (the next round's is sent, and told, once)."""
        self._pending = None
        why = {
            "revoked": "this device's certificate is revoked by the fleet's CRL",
            "unenrolled": "the coordinator has no key enrolled for this device",
        }.get(reason, reason)
        log.error(
            "round %d: the coordinator refuses this device's updates (%s): %s; not resending "
            "(its operator must enrol it again: docs/deploy.md, section 1)",
            round_, reason, why,
            extra={"event": "update_refused", "round": round_, "reason": reason},
        )  # fmt: skip

    def _expect_receipt(self, round_: int, payload: bytes) -> None:
        wait = self.resend_s
        self._pending = _Pending(
            round_, self.agent.run, payload, payload_digest(payload), time.monotonic() + wait,
            wait,
        )  # fmt: skip

    def _abandon(self, pending: _Pending) -> None:
        """The round of ``pending`` closed without a receipt: nothing is left to send it to."""
        if self._pending is pending:
            self._pending = None
        if self.agent.state.snapshot.pending_round == pending.round:
            self.agent.state.mark_published(pending.round)
        log.warning("round %d closed before the coordinator confirmed this update", pending.round)

    def _resend_if_due(self) -> None:
        """Send the pending update again until a receipt names it or its round closes: a
        broker's PUBACK does not mean the coordinator has it (a queue that overflowed in a
        burst dropped updates the broker had acknowledged)."""
        pending = self._pending
        if pending is None or time.monotonic() < pending.resend_at or self._stop:
            return
        pending.wait = min(self.resend_max_s, pending.wait * 2)
        pending.resend_at = time.monotonic() + pending.wait
        log.info("round %d: no receipt yet; sending the update again", pending.round)
        self.link.publish(update_topic(self.cfg.fleet, self.cfg.agent_id), pending.payload)

    def _say_mismatch(self, mismatch: str) -> None:
        """A device that cannot take part says why where the coordinator's status and
        operators look, once, and takes it back when it can answer again."""
        if mismatch != self._mismatch_said:
            self._mismatch_said = mismatch
            self._say_online(mismatch)

    def _say_online(self, reason: str) -> None:
        """The retained status: where the coordinator and operators look."""
        self.link.publish(self._status_topic, self._status(AgentState.ONLINE, reason), retain=True)

    def _process(self, payload: bytes) -> None:
        try:
            announcement = RoundAnnouncement.from_wire(
                payload, max_bytes=self.cfg.mqtt.max_payload_bytes
            )
        except UnsupportedVersion as exc:
            # Said where the coordinator and operators look, not only in this log: the
            # coordinator names such devices in its status (docs/deploy.md, "Upgrading").
            self._say_mismatch(self.agent.unreadable(exc.version))
            return
        except ProtocolError as exc:
            self.malformed += 1
            log.warning("ignoring a malformed round announcement: %s", exc)
            return
        self._speaks = announcement.wire_version
        self._secure.settle(announcement)
        decision = self.agent.handle(announcement, received_bytes=len(payload))
        if decision.secure is not None:
            self._secure.join(decision.secure)
        if (
            announcement.fleet == self.cfg.fleet
            and not decision.mismatch
            and decision.reason not in IGNORED
        ):
            if self._open_round != announcement.round and self._open_round is not None:
                # Restated every round: the coordinator counts an online status older
                # than rounds.online_ttl_s as stale.
                self._say_online(self._mismatch_said)
            self._open_round = announcement.round
            pending = self._pending
            other_run = announcement.wire_version >= 3 and pending is not None
            if pending is not None and (
                pending.round != announcement.round
                or (other_run and pending.run != announcement.run)
            ):
                self._abandon(pending)
        if decision.reason != "wrong_fleet":
            self._say_mismatch(decision.mismatch)
        if decision.payload is None:
            if not decision.mismatch and decision.reason not in IGNORED:
                # A mismatch was logged as a warning already, an ignored one is counted.
                log.info("round %d: %s", announcement.round, decision.reason)
            if decision.reason == "final":
                # Whoever waits for the fleet to finish (a simulation, an operator) reads
                # it from the retained status; any closing figures are written by now.
                self._say_online(FINISHED)
            if decision.reason == "budget_exhausted":
                self._say_online("privacy budget exhausted; not publishing")
            return
        info = self.link.publish(update_topic(self.cfg.fleet, self.cfg.agent_id), decision.payload)
        try:
            acknowledged = wait_acknowledged(
                info, timeout=self.publish_timeout, stopping=lambda: self._stop
            )
        except (RuntimeError, ValueError) as exc:
            acknowledged, why = False, str(exc)
        else:
            why = "stopping" if self._stop else f"no answer in {self.publish_timeout:g} s"
        # Sent again until the coordinator's receipt names it, acknowledged by the broker or not.
        self._expect_receipt(announcement.round, decision.payload)
        if not acknowledged:
            log.warning(
                "round %d: update not acknowledged yet (%s); kept for republishing",
                announcement.round,
                why,
            )
            return
        log.info("round %d: update published (%d bytes)", announcement.round, len(decision.payload))

    def _shutdown(self) -> None:
        self._stop = True
        self._secure.close()
        self.link.close(
            last_word=(self._status_topic, self._status(AgentState.OFFLINE, "shutdown"))
        )
