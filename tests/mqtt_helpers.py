"""Small paho-mqtt helpers for tests: a connected client and a message collector."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import paho.mqtt.client as mqtt

from fleet.transports.broker import BrokerAddress


class Collector:
    """Records every message on the subscribed filters; ``wait`` blocks on a condition."""

    def __init__(self) -> None:
        self.messages: list[mqtt.MQTTMessage] = []
        self._cond = threading.Condition()

    def on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._cond:
            self.messages.append(message)
            self._cond.notify_all()

    def wait(self, count: int, *, timeout: float = 10.0) -> list[mqtt.MQTTMessage]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.messages) >= count, timeout=timeout):
                raise TimeoutError(f"got {len(self.messages)} of {count} messages in {timeout} s")
            return list(self.messages)


@contextmanager
def connected(
    address: BrokerAddress, client_id: str, *, subscribe: tuple[str, ...] = ()
) -> Iterator[tuple[mqtt.Client, Collector]]:
    """A started paho client, subscribed (QoS 1) to ``subscribe`` before it is yielded."""
    collector = Collector()
    ready = threading.Event()
    subscribed = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    client.on_message = collector.on_message
    client.on_connect = lambda c, u, f, rc, p: ready.set()
    client.on_subscribe = lambda c, u, mid, rcs, p: subscribed.set()
    client.connect(address.host, address.port)
    client.loop_start()
    try:
        if not ready.wait(10):
            raise TimeoutError("no CONNACK in 10 s")
        if subscribe:
            client.subscribe([(t, 1) for t in subscribe])
            if not subscribed.wait(10):
                raise TimeoutError("no SUBACK in 10 s")
        yield client, collector
    finally:
        client.loop_stop()
        client.disconnect()
