"""The agent's MQTT loop: presence, announcements in, updates out.

paho runs the network on its own thread; training runs on the caller's thread so a long
round never starves keepalives. Only the newest announcement is kept: a device that was
offline for three rounds answers the current one, not the backlog.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

import paho.mqtt.client as mqtt

from edge_agent.agent import Agent
from protocol import (
    FINISHED,
    AgentState,
    ProtocolError,
    RoundAnnouncement,
    Status,
    round_topic,
    status_topic,
    update_topic,
)
from protocol.transport import (
    TakeoverWatch,
    backoff_delay,
    close_with_last_word,
    connect_failure,
    make_client,
    network_thread_alive,
    start_network,
    wait_acknowledged,
)
from protocol.version import package_version

log = logging.getLogger(__name__)


class AgentService:
    def __init__(self, *, agent: Agent, publish_timeout: float = 30.0) -> None:
        self.agent = agent
        self.cfg = agent.cfg
        self.publish_timeout = publish_timeout
        self._cond = threading.Condition()
        self._latest: bytes | None = None
        self._stop = False
        self._rng = random.Random()
        self._attempt = 0
        self._started = False
        self.malformed = 0
        # The reason of the retained online status, when it says why rounds are ignored.
        self._mismatch_said = ""
        self._status_topic = status_topic(self.cfg.fleet, self.cfg.agent_id)
        offline = self._status(AgentState.OFFLINE, "connection lost")
        self.client = make_client(
            self.cfg.mqtt, self.cfg.agent_id, will=(self._status_topic, offline)
        )
        self._takeover = TakeoverWatch(client_id=self.cfg.agent_id)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_message = self._on_message

    def _status(self, state: AgentState, reason: str = "") -> bytes:
        return Status(
            fleet=self.cfg.fleet,
            client=self.cfg.agent_id,
            state=state,
            version=package_version(),
            last_round=self.agent.last_round,
            reason=reason,
        ).to_wire()

    # -- paho callbacks (network thread) -----------------------------------------------

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        if reason.is_failure:
            log.error("broker refused the connection: %s", reason)
            return
        self._attempt = 0
        self._takeover.connected()
        client.subscribe(round_topic(self.cfg.fleet), qos=1)
        self._mismatch_said = ""  # said afresh when the retained announcement comes again
        client.publish(self._status_topic, self._status(AgentState.ONLINE), qos=1, retain=True)
        log.info(
            "connected to %s:%d as %s", self.cfg.mqtt.host, self.cfg.mqtt.port, self.cfg.agent_id
        )

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        if not self._stop:
            if taken_over := self._takeover.dropped():
                log.error("%s", taken_over)
            self._retry(client, f"disconnected ({reason})")

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        # The broker is down or unreachable: paho retries, but says nothing on its own.
        if not self._stop:
            self._retry(client, connect_failure(self.cfg.mqtt))

    def _retry(self, client: mqtt.Client, why: str) -> None:
        # paho backs off exponentially but in lock-step across a fleet; a random base per
        # attempt spreads the reconnects of many devices after a broker restart.
        self._attempt += 1
        mqtt_cfg = self.cfg.mqtt
        delay = backoff_delay(
            self._attempt,
            low=mqtt_cfg.reconnect_min_s,
            high=mqtt_cfg.reconnect_max_s,
            rng=self._rng,
        )
        # paho waits whole seconds, at least one: the next wait is exactly ``wait``.
        wait = max(1, round(delay))
        client.reconnect_delay_set(min_delay=wait, max_delay=max(1, int(mqtt_cfg.reconnect_max_s)))
        log.warning("%s; reconnecting in %d s", why, wait)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if not message.payload:
            return  # a cleared retained message
        with self._cond:
            self._latest = bytes(message.payload)
            self._cond.notify_all()

    # -- driver ------------------------------------------------------------------------

    def healthy(self) -> bool:
        """For the systemd watchdog: paho's network thread must be alive once started."""
        if not self._started:
            return True
        return network_thread_alive(self.client)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _next(self) -> bytes | None:
        with self._cond:
            self._cond.wait_for(lambda: self._stop or self._latest is not None)
            payload, self._latest = self._latest, None
            return None if self._stop else payload

    def run(self) -> None:
        start_network(self.client, self.cfg.mqtt)
        self._started = True
        try:
            while (payload := self._next()) is not None:
                self._process(payload)
        finally:
            self._shutdown()

    def _say_online(self, reason: str) -> None:
        """The retained status: where the coordinator and operators look."""
        self.client.publish(
            self._status_topic, self._status(AgentState.ONLINE, reason), qos=1, retain=True
        )

    def _process(self, payload: bytes) -> None:
        try:
            announcement = RoundAnnouncement.from_wire(
                payload, max_bytes=self.cfg.mqtt.max_payload_bytes
            )
        except ProtocolError as exc:
            self.malformed += 1
            log.warning("ignoring a malformed round announcement: %s", exc)
            return
        decision = self.agent.handle(announcement, received_bytes=len(payload))
        if decision.mismatch != self._mismatch_said and decision.reason != "wrong_fleet":
            # A device that cannot take part says why where the coordinator's status and
            # operators look, once, and takes it back when it can answer again.
            self._mismatch_said = decision.mismatch
            self._say_online(decision.mismatch)
        if decision.payload is None:
            if not decision.mismatch:  # a mismatch was logged as a warning already
                log.info("round %d: %s", announcement.round, decision.reason)
            if decision.reason == "final":
                # Whoever waits for the fleet to finish (a simulation, an operator) reads
                # it from the retained status; any closing figures are written by now.
                self._say_online(FINISHED)
            if decision.reason == "budget_exhausted":
                self._say_online("privacy budget exhausted; not publishing")
            return
        info = self.client.publish(
            update_topic(self.cfg.fleet, self.cfg.agent_id), decision.payload, qos=1
        )
        try:
            acknowledged = wait_acknowledged(
                info, timeout=self.publish_timeout, stopping=lambda: self._stop
            )
        except (RuntimeError, ValueError) as exc:
            acknowledged, why = False, str(exc)
        else:
            why = "stopping" if self._stop else f"no answer in {self.publish_timeout:g} s"
        if not acknowledged:
            log.warning(
                "round %d: update not acknowledged yet (%s); kept for republishing",
                announcement.round,
                why,
            )
            return
        self.agent.state.mark_published(announcement.round)
        log.info("round %d: update published (%d bytes)", announcement.round, len(decision.payload))

    def _shutdown(self) -> None:
        self._stop = True
        close_with_last_word(
            self.client,
            self._status_topic,
            self._status(AgentState.OFFLINE, "shutdown"),
            connected=self.client.is_connected(),
        )
