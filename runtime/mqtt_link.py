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
  (:class:`runtime.transport.TakeoverWatch`).

The link logs what it decides with the service's logger, so a service's lines keep its
name whichever side wrote them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode

from runtime.bulkread import client_class
from runtime.transport import (
    MqttSettings,
    TakeoverWatch,
    backoff_delay,
    connect_failure,
    load_credentials,
    wait_acknowledged,
)

log = logging.getLogger(__name__)


def make_client(
    settings: MqttSettings,
    client_id: str,
    *,
    will: tuple[str, bytes] | None = None,
    manual_ack: bool = False,
) -> mqtt.Client:
    """A paho client with QoS-1-friendly defaults: persistent session, TLS, credentials,
    and an optional retained Last Will. With ``manual_ack`` a received QoS 1 message is
    acknowledged only by ``client.ack``: one left unacknowledged is delivered again after
    a reconnect. Raises :class:`runtime.transport.CredentialsError` for an unusable
    password or TLS file."""
    credentials = load_credentials(settings)
    # clean_session=False keeps subscriptions and queued QoS 1 messages across reconnects.
    client = client_class()(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        clean_session=False,
        protocol=mqtt.MQTTv311,
        manual_ack=manual_ack,
    )
    # paho's default of 20 in-flight QoS 1 messages throttles a burst of updates.
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)
    client.reconnect_delay_set(
        min_delay=max(1, int(settings.reconnect_min_s)),
        max_delay=max(1, int(settings.reconnect_max_s)),
    )
    if settings.username is not None:
        client.username_pw_set(settings.username, credentials.password)
    if credentials.tls is not None:
        client.tls_set_context(credentials.tls)
    if will is not None:
        client.will_set(will[0], will[1], qos=1, retain=True)
    return client


@dataclass(frozen=True)
class Reconnect:
    """How a link tries the broker again after a failed attempt or a drop.

    ``jittered``: every wait is drawn afresh by :func:`runtime.transport.backoff_delay`
    from ``[mqtt] reconnect_min_s`` up to ``reconnect_max_s`` and logged ("reconnecting
    in N s"). paho's own backoff doubles in lock-step across a fleet; a random wait per
    attempt spreads the reconnects of many devices after a broker restart.

    Otherwise paho's own doubling from 1 s is kept ("retrying"): right for a single
    client such as the coordinator, which the broker can afford to see often.

    Either way no wait is longer than ``cap_s``, whatever ``reconnect_max_s`` says.
    """

    jittered: bool
    cap_s: float = math.inf

    def __post_init__(self) -> None:
        if not self.cap_s > 0:
            raise ValueError(f"Reconnect.cap_s must be positive, got {self.cap_s}")


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
        self._up = threading.Event()
        self._started = False
        self._closed = False
        self._takeover = TakeoverWatch(client_id=client_id)
        self._max_delay = max(1, int(min(settings.reconnect_max_s, reconnect.cap_s)))
        #: paho's client. The service talks to the link; tests may look inside.
        self.client = make_client(settings, client_id, will=will, manual_ack=manual_ack)
        if not reconnect.jittered:
            self.client.reconnect_delay_set(min_delay=1, max_delay=self._max_delay)
        self.client.on_connect = self._connected
        self.client.on_disconnect = self._disconnected
        self.client.on_connect_fail = self._connect_failed
        self.client.on_message = self._received

    # -- paho's callbacks (network thread; the first failed attempt: the caller's) -----

    def _connected(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        if reason.is_failure:
            self._log.error("broker refused the connection: %s", reason)
            return
        self._attempt = 0
        self._takeover.connected()
        if self.subscriptions:
            client.subscribe([(topic, 1) for topic in self.subscriptions])
        self._on_connected()
        self._up.set()

    def _disconnected(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        self._up.clear()
        if self._leaving():
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
        if self._leaving():
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
            self.client.connect(
                self.settings.host, self.settings.port, keepalive=self.settings.keepalive
            )
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
        """Wait until :meth:`is_connected`; False if ``timeout`` seconds passed first."""
        return self._up.wait(timeout)

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
