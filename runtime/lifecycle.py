"""How a long-running ProtoFleet service lives under systemd (or a terminal).

One loop serves both the agent and the coordinator:

- SIGTERM / SIGINT: tell systemd STOPPING=1, let the service finish its current step,
  write its state and say goodbye on the broker, then return.
- SIGHUP: re-read the configuration; a valid one replaces the running service (stopped
  the same clean way first), an invalid one is logged and the old one keeps running.
- READY=1 once the service is built and about to serve; the broker need not be reachable
  yet (a device that boots offline must not fail its start-up timeout).
- WATCHDOG=1 at half of ``WatchdogSec`` while the service reports itself healthy.

Signals are acted on by a thread of ours (:class:`SignalDispatch`), not in a Python signal
handler: see there why.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Protocol, TypeVar

from runtime.sdnotify import Notifier, Watchdog
from runtime.settings import ConfigError

log = logging.getLogger(__name__)

C = TypeVar("C")


class Service(Protocol):
    def run(self) -> None: ...

    def stop(self) -> None: ...

    def healthy(self) -> bool: ...


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: only there so the C handler (which feeds the wakeup fd)
    replaces the default action."""


class SignalDispatch:
    """While entered, the given signals call their action in a dispatch thread.

    Why not act in a Python signal handler: a signal sent to a process (``kill``, systemd
    stopping a unit, a terminal's Ctrl-C) may be taken by any of its threads, and the
    kernel prefers one that is running, such as paho's network thread. CPython's C
    handler then only flags it; the Python handler waits for the main thread to execute
    bytecode, which a main thread blocked on a lock with no timeout never does (a fleet
    worker sat out a Ctrl-C that way until it was killed a minute later). And a handler
    that does run interrupts the main thread wherever it is, possibly inside
    ``Event.wait`` holding the event's non-reentrant lock, so setting that event from the
    handler deadlocks. Here the C handler writes the signal number to a pipe
    (``signal.set_wakeup_fd``), whichever thread took it, and a thread of ours reads it
    and runs the action like any other thread would.

    Must be entered from the main thread (``set_wakeup_fd``'s rule); one per process.
    """

    def __init__(self, actions: Mapping[int, Callable[[int], None]]) -> None:
        self._actions = dict(actions)
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalDispatch:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd's requirement
        self._thread = threading.Thread(target=self._dispatch, name="signals", daemon=True)
        self._thread.start()
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, _ignore) for sig in self._actions}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)  # the dispatch thread reads end-of-file and returns
        if self._thread is not None:
            self._thread.join(timeout=10)
        os.close(self._read)

    def _dispatch(self) -> None:
        while data := os.read(self._read, 64):
            for signum in data:
                action = self._actions.get(signum)
                if action is not None:
                    try:
                        action(signum)
                    except Exception:  # a failed action must not end signal handling
                        log.exception("handling %s failed", signal.Signals(signum).name)


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

    def on_stop(signum: int) -> None:
        log.info("%s: %s received, stopping cleanly", name, signal.Signals(signum).name)
        reload_requested.clear()
        stop_requested.set()
        notifier.stopping()
        current[0].stop()

    def on_reload(signum: int) -> None:
        log.info("%s: SIGHUP received, reloading the configuration", name)
        reload_requested.set()
        notifier.reloading()
        current[0].stop()

    actions: dict[int, Callable[[int], None]] = {
        signal.SIGTERM: on_stop,
        signal.SIGINT: on_stop,
        signal.SIGHUP: on_reload,
    }
    with SignalDispatch(actions):
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
