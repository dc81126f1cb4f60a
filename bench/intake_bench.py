"""The sharded intake (issue 42): signed updates through real ``edge-coordinator worker``
processes behind a real Mosquitto.

- ``coordinator.signed_updates_per_s`` (one worker) and ``coordinator.signed_updates_per_s_2``
  (two): stand-in updates of 10 classes x 256 dimensions (float16, about 5.5 kB), each
  signed with its own enrolled Ed25519 key, from publish to durable receipt. So that the
  publisher does not share the two cores with the workers, the broker's queue is filled
  first: the workers create their persistent shared-subscription sessions, stop, the
  updates are published, then the workers start again and drain them. The figure is the
  burst over the time from the first receipt to the one that completes it (a worker sends
  a receipt after its commit; the time a process takes to start is not the intake's).
  The shipped broker queues 10,000 messages per session: this broker queues the whole
  burst (``max_queued_messages`` raised), so the one-worker run loses nothing.
  One and two workers alternate, each on a fresh broker and fresh databases, and each
  figure is the median of its runs; ``coordinator.signed_intake_2_over_1`` is their ratio.
  Both at the default ``sqlite_synchronous = "GROUP"`` (a receipt only after an fsync'd
  commit that holds it); ``coordinator.signed_updates_per_s_sync_full`` is one worker at
  ``"FULL"`` (an fsync per commit), drained in the same alternation, and
  ``coordinator.signed_group_over_full`` the ratio.
  ``coordinator.signed_intake_cores_1`` and ``_2`` are the CPU cores the workers used
  during the drain (medians): another process on the machine shows there, and the ratio
  is bounded by what they got (the broker and the receipt clock take a little too).
- ``reliability.signed_flood_honest_lost``: with two workers and the round owner
  (``edge-coordinator run`` with ``[workers]``) on the shipped broker limits, 100,000
  updates that name enrolled devices but carry another key's signature are published
  while a few honest stand-in devices answer two rounds. A device resends, every 10 s and
  doubling as the agent does, until a receipt names its update; the figure counts first
  sends that no receipt ever named (lost, recovered only by a resend). Each resend
  carries a new count so that its receipt is told apart from the first send's.
  ``reliability.signed_flood_rounds_closed`` is the rounds the owner closed (2 when
  nothing stalled), ``reliability.signed_flood_s`` the seconds from the first junk
  message to the second close, ``reliability.signed_flood_resends`` the devices' resends
  and ``reliability.signed_flood_broker_dropped`` the messages Mosquitto dropped from a
  full queue (``$SYS``): junk and honest alike, the reason an honest update can be lost.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric import ed25519

from bench.coordinator_bench import make_updates
from bench.intake_drain import Drain, drain
from bench.intake_fleet import (
    BIN,
    BYSTANDERS,
    FLEET,
    HONEST,
    RUN,
    WORKERS,
    Fleet,
    start_workers,
    stop,
    wait_ready,
)
from coordinator.service.owner_service import receipt_filter
from fleet.transports.broker import BrokerAddress, MosquittoBroker
from protocol import RoundAnnouncement, round_topic, update_topic
from protocol.auth import Signer, sign, signature_problem
from protocol.receipts import Receipt, payload_digest

#: Updates per drain: several seconds for one worker.
BURST = 20_000
#: Runs of each worker count, alternating 1, 2, 1, 2, ...
REPEATS = 3
JUNK = 100_000
#: The agent's default ``[mqtt] resend_s``; it doubles after each resend.
RESEND_S = 10.0
#: Flood messages published and not yet acknowledged by the broker, at most.
WINDOW = 2_000
#: Mosquitto's count of messages dropped because a session's queue was full.
DROPPED = "$SYS/broker/publish/messages/dropped"


# -- the drain --------------------------------------------------------------------------------


def drain_rates(fleet: Fleet) -> dict[str, float]:
    devices = sorted(fleet.devices)[:BURST]
    updates = make_updates(BURST, round_=1, seed=3)
    payloads = [fleet.signed(u, c, RUN) for u, c in zip(updates, devices, strict=True)]
    topics = [update_topic(FLEET, c) for c in devices]
    runs: dict[int, list[Drain]] = {1: [], 2: []}
    full: list[Drain] = []
    for _ in range(REPEATS):
        for workers in (1, 2):
            runs[workers].append(drain(fleet, workers, payloads, topics))
        # The other durable setting beside the default (GROUP), in the same alternation.
        full.append(drain(fleet, 1, payloads, topics, synchronous="FULL"))
    one, two = (float(np.median([d.rate for d in runs[w]])) for w in (1, 2))
    one_full = float(np.median([d.rate for d in full]))
    # How much of the machine the workers had: the ratio can be no better than the cores
    # they got (another process on the machine takes its share).
    cores = {w: float(np.median([d.cores for d in runs[w]])) for w in (1, 2)}
    return {
        "coordinator.signed_updates_per_s": one,
        "coordinator.signed_updates_per_s_2": two,
        "coordinator.signed_intake_2_over_1": two / one,
        "coordinator.signed_intake_cores_1": cores[1],
        "coordinator.signed_intake_cores_2": cores[2],
        "coordinator.signed_updates_per_s_sync_full": one_full,
        "coordinator.signed_group_over_full": one / one_full,
    }


# -- the flood --------------------------------------------------------------------------------


class HonestDevices:
    """``HONEST`` stand-in devices on one MQTT client. Each answers every round announced
    before the last (round 0 once :meth:`release` lets it), and resends after
    ``RESEND_S``, doubling, until a receipt signed by the coordinator names its round."""

    def __init__(self, fleet: Fleet, address: BrokerAddress, *, rounds: int) -> None:
        self.fleet = fleet
        self.rounds = rounds
        self.clients = sorted(fleet.devices)[:HONEST]
        self.run: str | None = None
        self.round = -1  # the latest announced
        self.closed_at: float | None = None  # when the last round's close was heard
        self.dropped = 0  # Mosquitto's count of messages its full queues dropped
        self.released: set[str] = set()  # may send round 0
        self.first: dict[tuple[int, str], str] = {}  # digest of each first send
        self.named: dict[tuple[int, str], set[str]] = {}  # digests receipts named
        self.resends = 0
        self._due: dict[tuple[int, str], tuple[float, float]] = {}  # (when, interval)
        self._lock = threading.Lock()
        self._heard = threading.Event()
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-honest")
        self._client.on_message = self._on_message
        self._client.connect(address.host, address.port)
        self._client.loop_start()
        self._client.subscribe([(round_topic(FLEET), 1), (receipt_filter(FLEET), 1), (DROPPED, 0)])

    def _on_message(self, _c: object, _u: object, message: mqtt.MQTTMessage) -> None:
        if message.topic == DROPPED:
            self.dropped = int(message.payload)
        elif message.topic == round_topic(FLEET):
            heard = RoundAnnouncement.from_wire(message.payload)
            with self._lock:
                self.run, self.round = heard.run, max(self.round, heard.round)
                if heard.round >= self.rounds and self.closed_at is None:
                    self.closed_at = time.perf_counter()
            self._heard.set()
        else:
            receipt = Receipt.from_wire(message.payload)
            if signature_problem(receipt, self.fleet.coordinator.public, run=self.run) is None:
                with self._lock:
                    self.named.setdefault((receipt.round, receipt.client), set()).add(
                        receipt.digest
                    )

    def wait_run(self, timeout: float) -> str:
        if not self._heard.wait(timeout):
            raise TimeoutError("the round owner announced no round")
        assert self.run is not None
        return self.run

    def release(self, index: int) -> None:
        with self._lock:
            self.released.add(self.clients[index])

    def step(self, now: float) -> None:
        """Send what is due: first sends of the open round, resends without a receipt."""
        with self._lock:
            round_, run, released = self.round, self.run, set(self.released)
            pending = [key for key in self.first if key[0] == round_ and not self.named.get(key)]
        if run is None or round_ >= self.rounds:
            return
        for client in self.clients:
            key = (round_, client)
            if key not in self.first and (round_ > 0 or client in released):
                self.first[key] = self._send(round_, client, run, attempt=0)
                self._due[key] = (now + RESEND_S, RESEND_S)
        for key in pending:
            when, interval = self._due[key]
            if now >= when:
                self.resends += 1
                self._send(*key, run, attempt=self.resends)
                self._due[key] = (now + 2 * interval, 2 * interval)

    def _send(self, round_: int, client: str, run: str, *, attempt: int) -> str:
        (update,) = make_updates(1, round_=round_, seed=self.clients.index(client))
        # A resend's count differs, so a receipt tells which copy a worker stored.
        update = dataclasses.replace(
            update, counts=(update.counts[0] + attempt, *update.counts[1:])
        )
        payload = self.fleet.signed(update, client, run)
        self._client.publish(update_topic(FLEET, client), payload, qos=1)
        return payload_digest(payload)

    def lost(self) -> int:
        """First sends no receipt named."""
        with self._lock:
            return sum(d not in self.named.get(key, set()) for key, d in self.first.items())

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


def publish_flood(
    address: BrokerAddress, payloads: list[bytes], topics: list[str], *, devices: HonestDevices
) -> None:
    """Publish ``JUNK`` messages, cycling through ``payloads``, at most ``WINDOW`` unacknowledged
    (paho would otherwise hold every packet in memory); honest device i may send its round-0
    update once (i + 1) / (HONEST + 1) of the flood is acknowledged."""
    acked = [0]
    cond = threading.Condition()
    marks = [(i + 1) * JUNK // (HONEST + 1) for i in range(HONEST)]

    def on_publish(*_: object) -> None:
        with cond:
            acked[0] += 1
            if marks and acked[0] >= marks[0]:
                marks.pop(0)
                devices.release(HONEST - len(marks) - 1)
            cond.notify_all()

    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-junk")
    pub.max_inflight_messages_set(1000)
    pub.on_publish = on_publish
    pub.connect(address.host, address.port)
    pub.loop_start()

    def acknowledged(count: int) -> None:
        with cond:
            if not cond.wait_for(lambda: acked[0] >= count, timeout=120):
                raise TimeoutError("the broker stopped acknowledging the flood")

    try:
        for i in range(JUNK):
            acknowledged(i - WINDOW)
            k = i % len(payloads)
            pub.publish(topics[k], payloads[k], qos=1)
        acknowledged(JUNK)
    finally:
        pub.loop_stop()
        pub.disconnect()


def signed_flood(fleet: Fleet) -> dict[str, float]:
    rounds = 2
    with tempfile.TemporaryDirectory(dir=fleet.root) as tmp, MosquittoBroker(
        extra_config="sys_interval 1\n"  # the shipped limits; $SYS counts the drops
    ) as broker:  # fmt: skip
        state = Path(tmp) / "state"
        config = fleet.config(broker.address.port, state, rounds=rounds)
        devices = HonestDevices(fleet, broker.address, rounds=rounds)
        owner_log = state.with_suffix(".owner.log")
        owner = subprocess.Popen(
            [str(BIN / "edge-coordinator"), "run", "--config", str(config)],
            stdout=subprocess.DEVNULL, stderr=owner_log.open("ab"),
        )  # fmt: skip
        workers: list[subprocess.Popen[bytes]] = []
        try:
            run = devices.wait_run(60)
            workers = start_workers(config, WORKERS)
            wait_ready(config, WORKERS)
            # Enrolled devices' names, another key's signatures: refused as bad_signature,
            # each after its Ed25519 check.
            stranger = Signer(ed25519.Ed25519PrivateKey.generate())  # enrolled nowhere
            names = sorted(fleet.devices)[HONEST : HONEST + BYSTANDERS]
            junk = [
                sign(dataclasses.replace(u, client=c), stranger, run=run).to_wire()
                for u, c in zip(make_updates(BYSTANDERS, round_=0, seed=9), names, strict=True)
            ]
            topics = [update_topic(FLEET, c) for c in names]
            with ThreadPoolExecutor(max_workers=1) as pool:
                start = time.perf_counter()
                flooding = pool.submit(publish_flood, broker.address, junk, topics, devices=devices)
                while owner.poll() is None and time.perf_counter() - start < 600:
                    devices.step(time.perf_counter())
                    time.sleep(0.02)  # the devices' clock: resends are due in whole seconds
                flooding.result(timeout=120)  # raises what the flood's publisher raised
            time.sleep(1.0)  # receipts, and $SYS's count, still on their way
            closed = devices.closed_at
            out = {
                "reliability.signed_flood_honest_lost": float(devices.lost()),
                "reliability.signed_flood_rounds_closed": float(min(devices.round, rounds)),
                "reliability.signed_flood_resends": float(devices.resends),
                "reliability.signed_flood_broker_dropped": float(devices.dropped),
            }
            if closed is not None:
                out["reliability.signed_flood_s"] = closed - start
            print(f"  flood: {out}; owner exit {owner.poll()}", file=sys.stderr)
            return out
        finally:
            stop([owner, *workers])
            devices.close()


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="protofleet-intake-") as tmp:
        fleet = Fleet.create(Path(tmp), BURST)
        return {**drain_rates(fleet), **signed_flood(fleet)}
