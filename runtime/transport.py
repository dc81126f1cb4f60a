"""MQTT connection settings and the parts of a connection that need no paho: credentials,
reconnect backoff, takeover detection, failure messages, waiting for an acknowledgement.

Nothing here imports paho, so reading settings costs nothing for a command that never
connects; :mod:`runtime.mqtt_link` makes the client and wires its callbacks.
"""

from __future__ import annotations

import random
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from protocol.limits import DEFAULT_MAX_PAYLOAD_BYTES

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

T = TypeVar("T")


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
    #: Agents: seconds before an update the coordinator has not confirmed with a receipt
    #: is sent again (then twice as long each time, up to 120 s), until the round closes.
    resend_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"mqtt.port must be 1-65535, got {self.port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("mqtt.tls_cert and mqtt.tls_key must be given together")
        if self.max_payload_bytes < 1024:
            raise ValueError("mqtt.max_payload_bytes must be at least 1024")
        if not 0 < self.resend_s <= 3600:
            raise ValueError(f"mqtt.resend_s must be in (0, 3600], got {self.resend_s}")
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


class TakeoverWatch:
    """Notices the broker closing connection after connection soon after it opened: the mark
    of another client connected with the same client id (two devices given one agent_id, a
    coordinator started twice). An MQTT 3.1.1 broker drops the older of two such sessions
    without saying why, and each side's reconnect then drops the other, for ever.

    :class:`runtime.mqtt_link.MqttLink` calls :meth:`connected` and :meth:`dropped` from
    paho's callbacks; ``dropped`` returns the warning to log, once per run of quick drops.
    """

    def __init__(
        self,
        *,
        client_id: str,
        quick_s: float = 10.0,
        times: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client_id = client_id
        self.quick_s = quick_s
        self.times = times
        self._clock = clock
        self._since: float | None = None
        self._quick = 0

    def connected(self) -> None:
        self._since = self._clock()

    def dropped(self) -> str | None:
        if self._since is None:
            return None  # a drop before any connection: nothing was taken over
        lasted, self._since = self._clock() - self._since, None
        self._quick = self._quick + 1 if lasted < self.quick_s else 0
        if self._quick != self.times:
            return None
        return (
            f"the broker closed {self.times} connections in a row within {self.quick_s:g} s "
            f"of opening them: is another client connected as {self.client_id!r}? (a broker "
            "drops the older of two connections with one client id; every device needs its "
            "own id)"
        )


class CredentialsError(ValueError):
    """A password or TLS file named in ``[mqtt]`` cannot be read or used."""


@dataclass(frozen=True)
class Credentials:
    """What ``[mqtt]``'s files hold, read once before a client is made."""

    password: str | None
    tls: ssl.SSLContext | None


def _read_setting(name: str, path: Path, what: str, read: Callable[[Path], T]) -> T:
    try:
        return read(path)
    except ssl.SSLError as exc:
        raise CredentialsError(
            f"mqtt.{name} {path}: not a usable {what} ({exc.reason or exc.strerror})"
        ) from exc
    except OSError as exc:
        raise CredentialsError(f"mqtt.{name} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise CredentialsError(f"mqtt.{name} {path}: not a UTF-8 text file") from exc


def load_credentials(settings: MqttSettings) -> Credentials:
    """The password and TLS context of ``settings``, or a :class:`CredentialsError` that
    names the setting and its file.

    The services call this before any slow start-up (backbones, database) so a mistyped path
    is reported at once, in one line, and not as an ssl traceback at the first connection.
    """
    password: str | None = None
    if settings.username is not None and settings.password_file is not None:
        password = _read_setting(
            "password_file",
            settings.password_file,
            "password file",
            lambda p: p.read_text(encoding="utf-8").strip(),
        )
    if not settings.uses_tls:
        return Credentials(password=password, tls=None)
    if settings.tls_ca is None:
        context = ssl.create_default_context()
    else:
        # cafile alone, as before: a private CA is trusted instead of the system's, not beside.
        context = _read_setting(
            "tls_ca",
            settings.tls_ca,
            "PEM CA certificate",
            lambda p: ssl.create_default_context(cafile=str(p)),
        )
    if settings.tls_cert is not None:
        assert settings.tls_key is not None  # __post_init__ insists on the pair
        key = settings.tls_key
        _read_setting("tls_key", key, "key", lambda p: p.read_bytes())
        _read_setting(
            "tls_cert",
            settings.tls_cert,
            "PEM certificate for mqtt.tls_key",
            lambda p: context.load_cert_chain(str(p), str(key)),
        )
    if settings.tls_insecure:
        context.check_hostname = False
    return Credentials(password=password, tls=context)


def connect_failure(settings: MqttSettings) -> str:
    """What an ``on_connect_fail`` callback should log: where, and why if paho's failed
    attempt says so.

    paho calls ``on_connect_fail`` from the ``except OSError`` around its connection attempt
    and passes no error; the error being handled there is the only record of why. Without
    it a refused port, a name that does not resolve and a CA that rejects the broker's
    certificate all read the same.
    """
    where = f"cannot reach the broker at {settings.host}:{settings.port}"
    exc = sys.exc_info()[1]
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{where} (its TLS certificate is not trusted: {exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return f"{where} (TLS handshake failed: {exc.reason or exc.strerror})"
    if isinstance(exc, OSError):
        return f"{where} ({exc.strerror or str(exc) or type(exc).__name__})"
    return where


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
