"""One drain of signed updates through real ``edge-coordinator worker`` processes: the
burst queued at a real Mosquitto first, then drained by the workers, timed from the first
durable receipt to the last (bench/intake_bench.py's module text; bench/durability_bench.py
drains the same way at each ``sqlite_synchronous``)."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from bench.coordinator_bench import BUNDLE, CLASSES, DIM
from bench.intake_fleet import (
    FLEET,
    RUN,
    WORKERS,
    Fleet,
    cpu_seconds,
    publish_one,
    start_workers,
    stop,
    stored_rows,
    wait_ready,
)
from bench.reliability_bench import _wait, publish_burst
from coordinator.service.owner_service import receipt_filter
from fleet.transports.broker import BrokerAddress, MosquittoBroker
from protocol import RoundAnnouncement, round_topic
from protocol.auth import sign
from runtime.bulkread import client_class


class ReceiptClock:
    """Times the receipts of ``expected`` distinct clients: the first and the last.

    It shares the two cores with the workers, so it reads through runtime/bulkread.py
    rather than paho's one packet per ``select()``, and checks no signature (the tests
    do: tests/test_worker_intake.py)."""

    def __init__(self, address: BrokerAddress, expected: int) -> None:
        self.expected = expected
        self.clients: set[str] = set()
        self.first: float | None = None
        self.last: float | None = None
        self.done = threading.Event()
        self._client = client_class()(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-clock")
        self._client.on_message = self._on_message
        subscribed = threading.Event()
        self._client.on_subscribe = lambda *_: subscribed.set()
        self._client.connect(address.host, address.port)
        self._client.loop_start()
        self._client.subscribe(receipt_filter(FLEET), qos=1)
        if not subscribed.wait(10):
            raise TimeoutError("no SUBACK for the receipt clock")

    def _on_message(self, _c: object, _u: object, message: mqtt.MQTTMessage) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.clients.add(message.topic)
        if len(self.clients) == self.expected and self.last is None:
            self.last = now
            self.done.set()

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


@dataclasses.dataclass(frozen=True)
class Drain:
    rate: float  # signed updates per second, from the broker's queue to durable receipts
    cores: float  # the workers' CPU seconds per second of the drain


def drain(
    fleet: Fleet, workers: int, payloads: list[bytes], topics: list[str], *,
    synchronous: str | None = None,
) -> Drain:  # fmt: skip
    """One drain of ``payloads`` by ``workers`` workers (module text), at
    ``sqlite_synchronous`` ``synchronous`` (None: the default)."""
    names = WORKERS[:workers]
    with tempfile.TemporaryDirectory(dir=fleet.root) as tmp, MosquittoBroker(
        extra_config=f"max_queued_messages {len(payloads) + 1_000}\n"
    ) as broker:  # fmt: skip
        state = Path(tmp) / "state"
        config = fleet.config(broker.address.port, state, synchronous=synchronous)
        announcement = RoundAnnouncement(
            fleet=FLEET, round=1, run=RUN, run_started=1.0, bundle=BUNDLE, method="fedpcl",
            classes=tuple(str(c) for c in range(CLASSES)), dim=DIM, deadline=2e9,
        )  # fmt: skip
        signed = sign(announcement, fleet.coordinator, run=RUN).to_wire()
        publish_one(broker.address, round_topic(FLEET), signed, retain=True)
        procs = start_workers(config, names)
        try:
            wait_ready(config, names)  # sessions made, the open round heard and stored
        finally:
            stop(procs)
        clock = ReceiptClock(broker.address, len(payloads))
        try:
            publish_burst(broker.address, topics, payloads, client_id="bench-devices")
            time.sleep(1.0)  # the broker settles; nothing else runs during the drain
            spawned = time.perf_counter()
            procs = start_workers(config, names)
            pids = [broker.pid or 0, *(p.pid for p in procs)]
            try:
                _wait(lambda: clock.first is not None, timeout=120, what="first receipt")
                before = [cpu_seconds(pid) for pid in pids]
                if not clock.done.wait(600):
                    raise TimeoutError(f"{len(clock.clients)} of {len(payloads)} receipts")
                used = [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
            finally:
                stop(procs)
        finally:
            clock.close()
        assert clock.first is not None and clock.last is not None
        rows = stored_rows(state)
        if rows != len(payloads):
            raise RuntimeError(f"{rows} rows stored for {len(payloads)} receipted updates")
        rate = (len(payloads) - 1) / (clock.last - clock.first)
        busy = ", ".join(f"{u / (clock.last - clock.first):.2f}" for u in used)
        print(f"  {workers} worker(s): {rate:,.0f} updates/s; first receipt "
              f"{clock.first - spawned:.2f} s after the start; cores busy (broker, "
              f"workers): {busy}; load {os.getloadavg()[0]:.2f}", file=sys.stderr)  # fmt: skip
        return Drain(rate=rate, cores=sum(used[1:]) / (clock.last - clock.first))
