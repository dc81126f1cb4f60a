"""The main loop the coordinator's two MQTT services share: the single coordinator
(coordinator/service/service.py) and the sharded fleet's round owner (coordinator/service/owner_service.py).

paho delivers messages on its network thread; each service decides there what it can and
wakes this loop for the rest. The loop starts the link, says it is ready once the broker
has the connection and its subscriptions, then wakes when told or when the service is due
(at least every ``TICK_S``) and runs the service's step, until :meth:`stop` or, with
``exit_when_done``, the final round. The watchdog's ``healthy`` reads its last tick.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod

from runtime.mqtt_link import MqttLink


class MainLoop(ABC):
    """A service's loop (module text); subclasses set :attr:`link` and implement the four
    hooks."""

    TICK_S: float
    link: MqttLink

    def __init__(self, *, exit_when_done: bool, logger: logging.Logger) -> None:
        self.exit_when_done = exit_when_done
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_tick: float | None = None
        self._loop_log = logger

    @abstractmethod
    def _final_round(self) -> int | None:
        """The round the final announcement opened, once it is out; None before."""

    @abstractmethod
    def _due(self) -> float:
        """Seconds until the service has something to do without being woken."""

    @abstractmethod
    def _step(self) -> None:
        """One turn: close what is due, publish what is to be published."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Leave: say goodbye on the broker and close the link."""

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _ticked_within(self, seconds: float) -> bool:
        """For the watchdog: the loop ran within ``seconds`` (or has not started yet) and
        paho's network thread is alive (its death would mean no reconnects, ever)."""
        if self._last_tick is None:
            return True
        return time.monotonic() - self._last_tick < seconds and self.link.healthy()

    def run(self, *, ready: threading.Event | None = None) -> None:
        """Serve until :meth:`stop` (or, with ``exit_when_done``, the final round)."""
        self.link.start()
        self._last_tick = time.monotonic()
        try:
            if ready is not None:
                self.link.wait_connected()
                ready.set()
            while not self._stop.is_set():
                final = self._final_round()
                if final is not None and self.exit_when_done:
                    self._loop_log.info(
                        "final round %d announced (max_rounds reached); exiting", final
                    )
                    break
                self._wake.wait(timeout=min(self._due(), self.TICK_S) + 0.01)
                self._wake.clear()
                self._last_tick = time.monotonic()
                self._step()
        finally:
            self._shutdown()
