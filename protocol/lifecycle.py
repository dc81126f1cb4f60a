"""How a long-running ProtoFleet service lives under systemd (or a terminal).

One loop serves both the agent and the coordinator:

- SIGTERM / SIGINT: tell systemd STOPPING=1, let the service finish its current step,
  write its state and say goodbye on the broker, then return.
- SIGHUP: re-read the configuration; a valid one replaces the running service (stopped
  the same clean way first), an invalid one is logged and the old one keeps running.
- READY=1 once the service is built and about to serve; the broker need not be reachable
  yet (a device that boots offline must not fail its start-up timeout).
- WATCHDOG=1 at half of ``WatchdogSec`` while the service reports itself healthy.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Protocol, TypeVar

from protocol.sdnotify import Notifier, Watchdog
from protocol.settings import ConfigError

log = logging.getLogger(__name__)

C = TypeVar("C")


class Service(Protocol):
    def run(self) -> None: ...

    def stop(self) -> None: ...

    def healthy(self) -> bool: ...


class CannotServe(Exception):
    """A configuration that cannot be served (missing bundle, unreadable data). At start-up
    the caller reports it as a usage error; on a reload the running configuration stays."""


def serve(
    *,
    name: str,
    load: Callable[[], C],
    make: Callable[[C], Service],
    notifier: Notifier | None = None,
    close: Callable[[Service], None] | None = None,
) -> None:
    """Build the service from ``load()``, run it, and handle stop and reload signals.

    ``make`` may raise :class:`CannotServe` (or a ConfigError) for a configuration it
    cannot serve; on the first start that propagates to the caller, on a reload the
    previous configuration is served again.
    """
    notifier = notifier or Notifier()
    cfg = load()
    service = make(cfg)
    reload_requested = threading.Event()
    stop_requested = threading.Event()
    current: list[Service] = [service]

    def on_stop(signum: int, frame: FrameType | None) -> None:
        log.info("%s: %s received, stopping cleanly", name, signal.Signals(signum).name)
        reload_requested.clear()
        stop_requested.set()
        notifier.stopping()
        current[0].stop()

    def on_reload(signum: int, frame: FrameType | None) -> None:
        log.info("%s: SIGHUP received, reloading the configuration", name)
        reload_requested.set()
        notifier.reloading()
        current[0].stop()

    previous = {
        sig: signal.signal(sig, handler)
        for sig, handler in (
            (signal.SIGTERM, on_stop),
            (signal.SIGINT, on_stop),
            (signal.SIGHUP, on_reload),
        )
    }
    try:
        while not stop_requested.is_set():
            watchdog = Watchdog(notifier=notifier, healthy=current[0].healthy)
            watchdog.start()
            notifier.ready(f"{name} serving")
            try:
                current[0].run()
            finally:
                watchdog.stop()
                if close is not None:
                    close(current[0])
            if not reload_requested.is_set():
                return
            reload_requested.clear()
            try:
                new_cfg = load()
                current[0] = make(new_cfg)
                cfg = new_cfg
                log.info("%s: configuration reloaded", name)
            except (ConfigError, CannotServe) as exc:
                log.error("%s: reload refused, keeping the running configuration: %s", name, exc)
                current[0] = make(cfg)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
