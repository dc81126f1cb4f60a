"""MQTT connection settings and the one place a paho client is configured.

paho-mqtt is imported lazily so the protocol package itself still needs only numpy and
msgpack; the agent and the coordinator both call :func:`make_client`.
"""

from __future__ import annotations

import contextlib
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.limits import DEFAULT_MAX_PAYLOAD_BYTES

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt


@dataclass(frozen=True)
class MqttSettings:
    """Where and how to connect. ``password_file`` keeps secrets out of the config file."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password_file: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_insecure: bool = False
    keepalive: int = 30
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"mqtt.port must be 1-65535, got {self.port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("mqtt.tls_cert and mqtt.tls_key must be given together")
        if self.max_payload_bytes < 1024:
            raise ValueError("mqtt.max_payload_bytes must be at least 1024")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError("need 0 < mqtt.reconnect_min_s <= mqtt.reconnect_max_s")

    @property
    def uses_tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None


def backoff_delay(attempt: int, *, low: float, high: float, rng: random.Random) -> float:
    """Capped exponential backoff with full jitter: uniform in [low, min(high, low * 2^n)].

    Jitter spreads the reconnects of a whole fleet after a broker restart instead of
    having every device retry in the same instant.
    """
    cap = min(high, low * (2 ** min(attempt, 30)))
    return rng.uniform(low, cap)


def network_thread_alive(client: mqtt.Client) -> bool:
    """Whether paho's loop_start() thread runs: the one that reconnects. paho keeps it in a
    private attribute; its death leaves a client that will never reconnect."""
    thread = getattr(client, "_thread", None)
    return thread is not None and thread.is_alive()


def make_client(
    settings: MqttSettings,
    client_id: str,
    *,
    will: tuple[str, bytes] | None = None,
) -> mqtt.Client:
    """A paho client with QoS-1-friendly defaults: persistent session, TLS, credentials,
    and an optional retained Last Will."""
    import paho.mqtt.client as mqtt

    # clean_session=False keeps subscriptions and queued QoS 1 messages across reconnects.
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        clean_session=False,
        protocol=mqtt.MQTTv311,
    )
    # paho's default of 20 in-flight QoS 1 messages throttles a burst of updates.
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)
    client.reconnect_delay_set(
        min_delay=max(1, int(settings.reconnect_min_s)),
        max_delay=max(1, int(settings.reconnect_max_s)),
    )
    if settings.username is not None:
        password = None
        if settings.password_file is not None:
            password = settings.password_file.read_text().strip()
        client.username_pw_set(settings.username, password)
    if settings.uses_tls:
        context = ssl.create_default_context(
            cafile=str(settings.tls_ca) if settings.tls_ca else None
        )
        if settings.tls_cert is not None:
            context.load_cert_chain(str(settings.tls_cert), str(settings.tls_key))
        if settings.tls_insecure:
            context.check_hostname = False
        client.tls_set_context(context)
    if will is not None:
        client.will_set(will[0], will[1], qos=1, retain=True)
    return client


def wait_acknowledged(
    info: mqtt.MQTTMessageInfo, *, timeout: float, stopping: Callable[[], bool]
) -> bool:
    """Whether the broker acknowledged ``info`` within ``timeout`` seconds.

    Gives up early once ``stopping()`` holds: a broker stopped together with the client (a
    fleet's Ctrl-C, a host shutting down) never answers, and a stop must not sit out the
    timeout. The agent republishes an update left unacknowledged. Raises what
    ``wait_for_publish`` raises for a message that cannot be sent.
    """
    deadline = time.monotonic() + timeout
    while not info.is_published() and not stopping():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        info.wait_for_publish(timeout=min(0.25, remaining))
    return info.is_published()


def close_with_last_word(
    client: mqtt.Client, topic: str, payload: bytes, *, connected: bool, timeout: float = 5.0
) -> None:
    """Publish a last retained message if ``connected``, wait for the broker to take it,
    then disconnect and stop the network thread.

    The wait ends early once the connection is gone: a broker stopping together with the
    client (a fleet's Ctrl-C) never answers, and what is lost is restated anyway (the
    agent's will says "offline", the coordinator republishes its round at the next start).
    """
    if connected:
        info = client.publish(topic, payload, qos=1, retain=True)
        with contextlib.suppress(RuntimeError, ValueError):
            wait_acknowledged(info, timeout=timeout, stopping=lambda: not client.is_connected())
    client.disconnect()
    client.loop_stop()
