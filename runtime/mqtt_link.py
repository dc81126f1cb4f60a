"""One service's connection to the broker: the only place paho's callbacks are wired.

paho calls back on its network thread; a :class:`MqttLink` takes those calls and hands
the service three events: *connected* (subscribed again, the service says it is back),
*message* (one received message; the service answers whether it is done with it) and
*dropped* (a connection that was up is gone). Everything else about the connection is
decided here, with its reason beside it:

- the client: a persistent session, QoS 1 subscriptions and publications, the bulk
  reader of :mod:`runtime.bulkread`, TLS, credentials and an optional retained will
  (:func:`make_client`);
- acknowledgement: with ``manual_ack`` a QoS 1 message is acknowledged only once its
  handler says it is done (the coordinator: once the update is committed), so one that
  could not be stored is delivered again after a reconnect;
- reconnects: the first attempt is made outside paho's thread, and a :class:`Reconnect`
  says how long to wait after a failed attempt or a drop, jittered for a fleet of devices;
- takeover: a run of quick drops is told as a likely second client with this client id
  (:class:`runtime.transport.TakeoverWatch`);
- refusal: a broker that will not have this client (a CONNACK that refuses it, a TLS
  alert about its certificate, or a connection closed before any CONNACK, which is how
  Mosquitto refuses a revoked certificate over TLS 1.3) is said plainly, at the 1st, 2nd,
  4th, 8th... refusal in a row, and tried again only every :data:`REFUSED_WAIT_S` or so:
  it will refuse again until someone changes its files or this client's.

The link logs what it decides with the service's logger, so a service's lines keep its
name whichever side wrote them.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from runtime.mqtt_client import (
    Reconnect,
    certificate_refusal,
    closed_unanswered,
    make_client,
    probe_refusal,
)
from runtime.transport import (
    MqttSettings,
    TakeoverWatch,
    backoff_delay,
    connect_failure,
    wait_acknowledged,
)

log = logging.getLogger(__name__)

#: The least wait before trying a broker that refused this client again (within
#: ``[mqtt] reconnect_max_s`` and the link's cap): a refusal stands until someone acts.
REFUSED_WAIT_S = 30.0


class MqttLink:
    """A service's MQTT connection: paho's callbacks in, three events out (module text).

    ``on_connected()`` runs on paho's network thread after every (re)connect, once the
    ``subscriptions`` (QoS 1) are asked for; the link counts as connected once it returns.
    ``on_message(message)`` runs there for every message and returns whether the service
    is done with it; under ``manual_ack`` only then is it acknowledged. Nothing may escape
    either into paho's thread: an exception there ends the thread, and every reconnect
    with it. ``on_dropped(reason)`` is told of a lost connection (not of a failed attempt).

    ``stopping()`` says the service is on its way out: a drop or a failed attempt is then
    its own doing and is not reported, as after :meth:`close`.
    """

    def __init__(
        self,
        *,
        settings: MqttSettings,
        client_id: str,
        subscriptions: Sequence[str],
        on_connected: Callable[[], None],
        on_message: Callable[[mqtt.MQTTMessage], bool],
        on_dropped: Callable[[str], None] | None = None,
        reconnect: Reconnect,
        will: tuple[str, bytes] | None = None,
        manual_ack: bool = False,
        session_expiry_s: int | None = None,
        stopping: Callable[[], bool] = lambda: False,
        logger: logging.Logger = log,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.subscriptions = tuple(subscriptions)
        self.reconnect = reconnect
        self.manual_ack = manual_ack
        self._on_connected = on_connected
        self._on_message = on_message
        self._on_dropped = on_dropped
        self._stopping = stopping
        self._log = logger
        self._rng = rng if rng is not None else random.Random()
        self._attempt = 0
        self._refusals = 0  # refusals in a row, since the last accepted connection
        # Where the current attempt stands: "connecting" (no CONNACK yet), "refused" (by
        # its CONNACK, already said), "up", or "idle".
        self._phase = "idle"
        self._up = threading.Event()
        # Set once the broker has acknowledged this connection's subscriptions: a
        # publication by another client before that may not reach us.
        self._subscribed = threading.Event()
        self._subscribe_mid: int | None = None
        #: The subscriptions the broker refused at the last (re)connect.
        self.refused_subscriptions: list[str] = []
        self._started = False
        self._closed = False
        self._takeover = TakeoverWatch(client_id=client_id)
        self._max_delay = max(1, int(min(settings.reconnect_max_s, reconnect.cap_s)))
        #: paho's client. The service talks to the link; tests may look inside.
        #: MQTT 5 with a session the broker keeps this long after the client goes (its
        #: share of a shared subscription, its unacknowledged messages); None: MQTT 3.1.1.
        self.session_expiry_s = session_expiry_s
        self.client = make_client(settings, client_id, will=will, manual_ack=manual_ack,
                                  mqtt5=session_expiry_s is not None)  # fmt: skip
        if not reconnect.jittered:
            self.client.reconnect_delay_set(min_delay=1, max_delay=self._max_delay)
        self.client.on_pre_connect = self._connecting
        self.client.on_connect = self._connected
        self.client.on_subscribe = self._subscribe_acknowledged
        self.client.on_disconnect = self._disconnected
        self.client.on_connect_fail = self._connect_failed
        self.client.on_message = self._received

    # -- paho's callbacks (network thread; the first failed attempt: the caller's) -----

    def _connecting(self, client: mqtt.Client, userdata: Any) -> None:
        self._phase = "connecting"

    def _connected(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        if reason.is_failure:
            self._phase = "refused"
            if not self._leaving():
                self._refused(str(reason))
            return
        self._phase = "up"
        if self._refusals:
            self._refusals = 0
            if not self.reconnect.jittered:  # back to paho's own doubling from 1 s
                self.client.reconnect_delay_set(min_delay=1, max_delay=self._max_delay)
        self._attempt = 0
        self._takeover.connected()
        if self.subscriptions:
            self._subscribed.clear()
            _, self._subscribe_mid = client.subscribe([(topic, 1) for topic in self.subscriptions])
        else:
            self._subscribed.set()
        self._on_connected()
        self._up.set()

    def _subscribe_acknowledged(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any
    ) -> None:
        if mid == self._subscribe_mid:
            refused = [f"{t}: {r}" for t, r in zip(self.subscriptions, reasons, strict=False)
                       if getattr(r, "is_failure", False)]  # fmt: skip
            if refused:
                # A broker that will not serve a subscription (an MQTT 5 shared one on a
                # broker without them, an ACL): nothing would ever arrive on it.
                self._log.error("broker refused subscription(s): %s", "; ".join(refused))
            self.refused_subscriptions = refused
            self._subscribed.set()

    def _disconnected(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        self._up.clear()
        self._subscribed.clear()
        phase, self._phase = self._phase, "idle"
        if self._leaving() or phase == "refused":  # a refusing CONNACK is told already
            return
        if phase == "connecting":
            # Closed before any CONNACK: a failed attempt, not a lost connection. Over
            # TLS 1.3 no reason came with it: a TLS 1.2 handshake asks for one.
            self._refused(probe_refusal(self.settings) or closed_unanswered(self.settings))
            return
        if taken_over := self._takeover.dropped():
            self._log.error("%s", taken_over)
        if self.reconnect.jittered:
            self._wait_before_next(f"disconnected ({reason})")
        else:
            self._log.warning("disconnected from broker (%s); paho will reconnect", reason)
        if self._on_dropped is not None:
            self._on_dropped(str(reason))

    def _connect_failed(self, client: mqtt.Client, userdata: Any) -> None:
        # The broker is down or unreachable: paho retries, but says nothing on its own.
        self._phase = "idle"
        if self._leaving():
            return
        refusal = certificate_refusal(sys.exc_info()[1], self.settings)
        if refusal is not None:
            self._refused(refusal)
            return
        why = connect_failure(self.settings)  # here: it reads the error being handled
        if self.reconnect.jittered:
            self._wait_before_next(why)
        else:
            self._log.warning("%s; retrying", why)

    def _received(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if self._on_message(message) and self.manual_ack:
            client.ack(message.mid, message.qos)

    def _wait_before_next(self, why: str) -> None:
        self._attempt += 1
        delay = backoff_delay(
            self._attempt,
            low=self.settings.reconnect_min_s,
            high=min(self.settings.reconnect_max_s, self.reconnect.cap_s),
            rng=self._rng,
        )
        # paho waits whole seconds, at least one, and doubles from its minimum delay after
        # each failure; set afresh, the next wait is exactly ``wait``.
        wait = max(1, round(delay))
        self.client.reconnect_delay_set(min_delay=wait, max_delay=self._max_delay)
        self._log.warning("%s; reconnecting in %d s", why, wait)

    def _refused(self, why: str) -> None:
        """The broker will not have this client: said plainly, and tried again seldom."""
        self._refusals += 1
        count = self._refusals
        high = min(self.settings.reconnect_max_s, self.reconnect.cap_s)
        low = min(high, max(self.settings.reconnect_min_s, REFUSED_WAIT_S))
        wait = max(1, round(self._rng.uniform(low, high) if self.reconnect.jittered else high))
        self.client.reconnect_delay_set(min_delay=wait, max_delay=max(wait, self._max_delay))
        # The 1st, 2nd, 4th, 8th... in a row at ERROR: once said, a standing refusal need
        # not fill the log at every attempt.
        level = logging.ERROR if count & (count - 1) == 0 else logging.DEBUG
        if count == 1:
            self._log.log(
                level,
                "broker refused the connection: %s; it refuses it again until that is fixed "
                "(next attempt in %d s)",
                why,
                wait,
            )
        else:
            self._log.log(
                level,
                "broker refused the connection again (%d times in a row): %s; next attempt in %d s",
                count,
                why,
                wait,
            )

    def _leaving(self) -> bool:
        return self._closed or self._stopping()

    # -- the service's side ------------------------------------------------------------

    def start(self) -> None:
        """Connect to the broker and start paho's network thread, which reconnects from
        then on.

        The first attempt is made here, not by that thread: after a failed *first* attempt
        paho's thread waits the reconnect delay twice (d, then 2d) before trying again, so
        a service that had logged "reconnecting in 2 s" tried again after 6. A failure here
        is reported as one in the thread would be, with the error in hand.
        """
        try:
            if self.session_expiry_s is None:
                self.client.connect(
                    self.settings.host, self.settings.port, keepalive=self.settings.keepalive
                )
            else:
                # paho keeps these for its reconnects: the session is resumed each time.
                properties = Properties(PacketTypes.CONNECT)
                properties.SessionExpiryInterval = self.session_expiry_s
                self.client.connect(
                    self.settings.host, self.settings.port, keepalive=self.settings.keepalive,
                    clean_start=False, properties=properties,
                )  # fmt: skip
        except OSError:
            self._connect_failed(self.client, None)
        self.client.loop_start()
        self._started = True

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> mqtt.MQTTMessageInfo:
        """Publish at QoS 1, as every publication of the protocol is."""
        return self.client.publish(topic, payload, qos=1, retain=retain)

    def is_connected(self) -> bool:
        """Whether the broker has the connection and ``on_connected`` has run for it."""
        return self._up.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`is_connected` and the broker has acknowledged the
        subscriptions (what another client publishes from then on reaches this one); False
        if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._up.wait(timeout):
            return False
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._subscribed.wait(remaining)

    def healthy(self) -> bool:
        """For a watchdog: once started, paho's network thread must be alive. paho keeps it
        in a private attribute; its death leaves a client that will never reconnect."""
        if not self._started:
            return True
        thread = getattr(self.client, "_thread", None)
        return thread is not None and thread.is_alive()

    def close(self, last_word: tuple[str, bytes] | None = None, *, timeout: float = 5.0) -> None:
        """Publish ``last_word`` (topic, payload) retained if connected, wait for the broker
        to take it, then disconnect and stop the network thread.

        The wait ends early once the connection is gone: a broker stopping together with
        the service (a fleet's Ctrl-C) never answers, and what is lost is restated anyway
        (an agent's will says "offline", the coordinator republishes its round at the next
        start).
        """
        self._closed = True
        if last_word is not None and self.is_connected():
            info = self.publish(*last_word, retain=True)
            with contextlib.suppress(RuntimeError, ValueError):
                wait_acknowledged(
                    info, timeout=timeout, stopping=lambda: not self.client.is_connected()
                )
        self.client.disconnect()
        # paho's loop_stop checks its thread, then joins it; the thread clears that
        # reference as it ends, and a disconnect can end it in between (paho issue #872):
        # one agent of a thousand stopping at once died on AttributeError. It has ended
        # then, as asked.
        with contextlib.suppress(AttributeError):
            self.client.loop_stop()
