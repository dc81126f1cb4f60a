"""systemd's notify protocol with the standard library only.

A ``Type=notify`` unit learns that the service is up (``READY=1``), alive
(``WATCHDOG=1``) and going down (``STOPPING=1``) from datagrams sent to the socket named
in ``$NOTIFY_SOCKET``. Outside systemd the variable is unset and every call is a no-op, so
the services use this unconditionally. libsystemd is not needed: the protocol is one
``sendto`` of ``KEY=VALUE`` lines.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends notify messages to ``$NOTIFY_SOCKET`` (or nothing when it is unset)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        # A leading '@' names a socket in the abstract namespace (a NUL byte on the wire).
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self.watchdog_interval_s = _watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines; keys are upper-cased. Returns whether it was sent."""
        if not self._address:
            return False
        message = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            # A socket per message and no lock: this runs inside signal handlers too, which
            # may interrupt another send on the same thread.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self._address)
        except OSError as exc:
            # Losing a notification must never take the service down with it.
            log.warning("cannot notify systemd at %s: %s", self._address.lstrip("\0"), exc)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.send(ready=1, status=status) if status else self.send(ready=1)

    def status(self, text: str) -> bool:
        return self.send(status=text)

    def stopping(self) -> bool:
        return self.send(stopping=1)

    def reloading(self) -> bool:
        return self.send(reloading=1)

    def watchdog(self) -> bool:
        return self.send(watchdog=1)


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """``WatchdogSec`` in seconds when systemd asked this very process for pings."""
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None  # meant for a parent, not for us
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


class Watchdog:
    """Pings systemd's watchdog at half its interval while ``healthy()`` holds.

    A thread that pinged unconditionally would keep a wedged service alive forever; the
    health check is what lets systemd restart a process whose MQTT loop or main loop has
    died while the process itself lingers.
    """

    def __init__(self, *, notifier: Notifier, healthy: Callable[[], bool]) -> None:
        self.notifier = notifier
        self.healthy = healthy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pings = 0

    def start(self) -> None:
        interval = self.notifier.watchdog_interval_s
        if interval is None or not self.notifier.enabled:
            return
        self._thread = threading.Thread(
            target=self._run, args=(interval / 2,), name="sd-watchdog", daemon=True
        )
        self._thread.start()

    def _run(self, period: float) -> None:
        while True:
            if self.healthy():
                self.notifier.watchdog()
                self.pings += 1
            else:
                log.error("service unhealthy: withholding the systemd watchdog ping")
            if self._stop.wait(period):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
