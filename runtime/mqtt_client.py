"""The paho client a link (runtime/mqtt_link.py) is built on, and what it decides before
a connection is up: the client itself (a persistent session, the bulk reader, TLS,
credentials, an optional retained will), how long to wait before the next attempt, and
how to say that a broker refused this client's certificate."""

from __future__ import annotations

import math
import socket
import ssl
from dataclasses import dataclass

import paho.mqtt.client as mqtt

from runtime.bulkread import client_class
from runtime.transport import (
    MqttSettings,
    load_credentials,
)

#: TLS alerts by which a broker refuses a client certificate (OpenSSL's reason names end
#: so), and what each says of it.
_CERTIFICATE_ALERTS = {
    "ALERT_CERTIFICATE_REVOKED": "is revoked",
    "ALERT_CERTIFICATE_EXPIRED": "has expired",
    "ALERT_UNKNOWN_CA": "is not issued by a CA the broker trusts",
    "ALERT_BAD_CERTIFICATE": "is not accepted",
    "ALERT_UNSUPPORTED_CERTIFICATE": "is not accepted",
    "ALERT_CERTIFICATE_UNKNOWN": "is not accepted",
    "ALERT_ACCESS_DENIED": "is not accepted",
}


def certificate_refusal(exc: BaseException | None, settings: MqttSettings) -> str | None:
    """What a failed TLS handshake says of the broker refusing this client's certificate,
    or None if it is no such refusal (a broker down, a broker certificate not trusted)."""
    if not isinstance(exc, ssl.SSLError) or isinstance(exc, ssl.SSLCertVerificationError):
        return None
    reason = exc.reason or ""
    if reason.endswith("ALERT_CERTIFICATE_REQUIRED"):
        return "it requires a client certificate: set mqtt.tls_cert and mqtt.tls_key"
    for alert, what in _CERTIFICATE_ALERTS.items():
        if reason.endswith(alert):
            return f"this client's certificate mqtt.tls_cert {settings.tls_cert} {what}"
    return None


#: The longest a probe of the broker's reason may take (it runs on paho's thread, after a
#: refusal, and a refused client waits 30 s or more before its next attempt anyway).
PROBE_TIMEOUT_S = 5.0


def probe_refusal(settings: MqttSettings) -> str | None:
    """Why the broker refuses this client's certificate, asked in a TLS 1.2 handshake, or
    None if that learns nothing (no client certificate, a handshake that passes, a
    broker that refuses TLS 1.2, a network error).

    A broker whose minimum is TLS 1.2 (the shipped ``tls_version tlsv1.2``) lets a client
    negotiate TLS 1.3, where it checks the client's certificate after the handshake and
    closes the connection without a reason; in TLS 1.2 it refuses the certificate inside
    the handshake with an alert that names it (revoked, expired, unknown CA)."""
    if settings.tls_cert is None:
        return None
    try:
        context = load_credentials(settings).tls
        if context is None:
            return None
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        with socket.create_connection(
            (settings.host, settings.port), timeout=PROBE_TIMEOUT_S
        ) as raw:
            context.wrap_socket(raw, server_hostname=settings.host).close()
    except ssl.SSLError as exc:
        return certificate_refusal(exc, settings)
    except (OSError, ValueError):
        return None
    return None


def closed_unanswered(settings: MqttSettings) -> str:
    """Why a broker closes a connection before its CONNACK: for a client with a TLS
    certificate, almost always that it refuses the certificate. Over TLS 1.3 the client
    finishes its handshake before the broker checks the certificate, so the refusal
    arrives as a closed connection with no reason (paho: "Unspecified error")."""
    if settings.tls_cert is not None:
        return (
            "it closed the connection before answering: it does not accept this client's "
            f"certificate mqtt.tls_cert {settings.tls_cert} (revoked, expired or not "
            "issued by the CA it trusts; the broker's log says which)"
        )
    return "it closed the connection before answering"


def make_client(
    settings: MqttSettings,
    client_id: str,
    *,
    will: tuple[str, bytes] | None = None,
    manual_ack: bool = False,
    mqtt5: bool = False,
) -> mqtt.Client:
    """A paho client with QoS-1-friendly defaults: persistent session, TLS, credentials,
    and an optional retained Last Will. With ``manual_ack`` a received QoS 1 message is
    acknowledged only by ``client.ack``: one left unacknowledged is delivered again after
    a reconnect. ``mqtt5``: MQTT 5 (the coordinator's workers: shared subscriptions do
    not exist in 3.1.1, which the device-facing services speak); its session is kept by
    ``clean_start=False`` and an expiry at connect (:class:`runtime.mqtt_link.MqttLink`).
    Raises :class:`runtime.transport.CredentialsError` for an unusable password or TLS
    file."""
    credentials = load_credentials(settings)
    if mqtt5:
        client = client_class()(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5,
            manual_ack=manual_ack,
        )  # fmt: skip
    else:
        # clean_session=False keeps subscriptions and queued QoS 1 messages across
        # reconnects.
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
