"""The embedded broker: amqtt in a background thread, for machines without Mosquitto.

Same shape as :class:`fleet.transports.broker.MosquittoBroker` (``address``, ``start``, ``stop``,
context manager), so the fleet runner does not care which one it got. amqtt is pure
Python and slower than Mosquitto; a fleet of a few dozen agents is what it is for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from fleet.transports.broker import (
    BrokerAddress,
    BrokerError,
    ManagedBroker,
    free_port,
    wait_for_port,
)


class AmqttBroker(ManagedBroker):
    def __init__(
        self, *, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 10.0
    ) -> None:
        self._host = host
        self._port = port or free_port(host)
        self._timeout = startup_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None
        self._failure: BaseException | None = None

    @property
    def address(self) -> BrokerAddress:
        return BrokerAddress(self._host, self._port)

    def _config(self) -> dict[str, Any]:
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{self._host}:{self._port}"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            },
        }

    def start(self) -> AmqttBroker:
        try:
            from amqtt.broker import Broker
        except ImportError as exc:
            raise BrokerError("amqtt is not installed (pip install 'protofleet[fleet]')") from exc
        # amqtt logs every connection, and as errors the bare TCP probes of wait_for_port;
        # a fleet of agents would drown the console. Its own failures still raise here.
        logging.getLogger("amqtt").setLevel(logging.CRITICAL)
        loop = asyncio.new_event_loop()
        self._loop = loop
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._broker = Broker(self._config(), loop=loop)
                loop.run_until_complete(self._broker.start())
            except BaseException as exc:  # reported to the starting thread below
                self._failure = exc
                started.set()
                return
            started.set()
            loop.run_forever()

        self._thread = threading.Thread(target=serve, name="amqtt-broker", daemon=True)
        self._thread.start()
        started.wait(self._timeout)
        if self._failure is not None:
            self.stop()
            raise BrokerError(f"amqtt failed to start: {self._failure}")
        wait_for_port(self._host, self._port, timeout=self._timeout)
        return self

    def stop(self) -> None:
        loop, broker = self._loop, self._broker
        if loop is not None and loop.is_running() and broker is not None:
            done = asyncio.run_coroutine_threadsafe(broker.shutdown(), loop)
            try:
                done.result(timeout=10)
            except Exception:  # shutting down regardless
                logging.getLogger(__name__).debug("amqtt shutdown raised", exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if loop is not None and not loop.is_running():
            loop.close()
        self._loop = self._broker = self._thread = None
