"""What a receipt that survives a power cut costs (issue 53): the signed intake at
``sqlite_synchronous = "FULL"`` (an fsync per commit) and ``"GROUP"`` (group commit: one
fsync per batch of receipts, coordinator/storage/group_sync.py), both safe, beside
``"NORMAL"`` (not safe), and the device's durable writes with and without their fsync.

- ``coordinator.signed_updates_per_s_full`` and ``_normal``: one ``edge-coordinator worker``
  draining a burst of signed updates from the broker's queue to durable receipts, as
  ``coordinator.signed_updates_per_s`` in bench/intake_bench.py (same harness, the two
  settings alternating on fresh brokers and databases, medians of their runs).
- ``coordinator.signed_single_updates_per_s_full`` and ``_normal``: the same burst into a
  single ``edge-coordinator run`` (no worker tier): it is started once to draw its run and
  open round 0, stopped, the burst signed for that run is queued on its persistent
  session, and it is started again to drain it.
- ``..._group`` the same at GROUP; ``coordinator.signed_full_over_normal``,
  ``..._group_over_normal`` and their ``single`` twins: the ratios (below 1: the cost).
- ``agent.ledger_records_per_s_fsync`` and ``_no_fsync``: the privacy ledger's
  :meth:`Ledger.record` (the write that must be durable before a release leaves), the
  ledger growing to ``LEDGER_ROUNDS`` rounds, with its temp-file fsync and folder fsync,
  and with both made no-ops (what skipping them would save). The agent's ``state.json``
  (its last round and pending update) goes through the same ``atomic_write``.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import paho.mqtt.client as mqtt

from bench.coordinator_bench import make_updates
from bench.intake_drain import ReceiptClock, drain
from bench.intake_fleet import BIN, FLEET, RUN, Fleet, stop
from bench.reliability_bench import publish_burst
from edge_agent.privacy.accounting import Event
from edge_agent.privacy.ledger import Ledger
from fleet.transports.broker import MosquittoBroker
from protocol import RoundAnnouncement, round_topic, update_topic

#: Updates per drain: a few seconds at either setting.
BURST = 6_000
#: Runs of each setting, alternating.
REPEATS = 3
SETTINGS = ("FULL", "GROUP", "NORMAL")
LEDGER_ROUNDS = 300


def _start_single(config: Path) -> subprocess.Popen[bytes]:
    log = config.with_suffix(".log")
    return subprocess.Popen(
        [str(BIN / "edge-coordinator"), "run", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=log.open("ab"),
    )  # fmt: skip


def _announced_run(port: int, proc: subprocess.Popen[bytes]) -> str:
    """The run id of the announcement retained on the round topic (waits for one)."""
    heard: list[RoundAnnouncement] = []
    got = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-listen")

    def on_message(_c: object, _u: object, message: mqtt.MQTTMessage) -> None:
        heard.append(RoundAnnouncement.from_wire(message.payload))
        got.set()

    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.subscribe(round_topic(FLEET), qos=1)
    try:
        if not got.wait(60):
            raise TimeoutError(f"no announcement (coordinator exit {proc.poll()})")
    finally:
        client.loop_stop()
        client.disconnect()
    return heard[-1].run


def single_drain(fleet: Fleet, synchronous: str, clients: list[str]) -> float:
    """Signed updates a second from the broker's queue to durable receipts, one
    coordinator at ``synchronous`` (module text)."""
    with tempfile.TemporaryDirectory(dir=fleet.root) as tmp, MosquittoBroker(
        extra_config=f"max_queued_messages {len(clients) + 1_000}\n"
    ) as broker:  # fmt: skip
        state = Path(tmp) / "state"
        config = fleet.config(
            broker.address.port, state, quorum=len(clients) + 1, synchronous=synchronous,
            workers=False,
        )  # fmt: skip
        proc = _start_single(config)
        try:
            run = _announced_run(broker.address.port, proc)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        updates = make_updates(len(clients), round_=0, seed=5)
        payloads = [fleet.signed(u, c, run) for u, c in zip(updates, clients, strict=True)]
        clock = ReceiptClock(broker.address, len(payloads))
        try:
            publish_burst(broker.address, [update_topic(FLEET, c) for c in clients], payloads,
                          client_id="bench-devices")  # fmt: skip
            procs = [_start_single(config)]
            try:
                if not clock.done.wait(600):
                    raise TimeoutError(f"{len(clock.clients)} of {len(payloads)} receipts")
            finally:
                stop(procs)
        finally:
            clock.close()
        assert clock.first is not None and clock.last is not None
        with sqlite3.connect(f"file:{state / 'coordinator.sqlite3'}?mode=ro", uri=True) as db:
            rows = int(db.execute("SELECT COUNT(*) FROM updates").fetchone()[0])
        if rows != len(payloads):
            raise RuntimeError(f"{rows} rows stored for {len(payloads)} receipted updates")
        rate = (len(payloads) - 1) / (clock.last - clock.first)
        print(f"  single coordinator, {synchronous}: {rate:,.0f} updates/s", file=sys.stderr)
        return rate


def ledger_rate(root: Path, *, fsync: bool) -> float:
    """Ledger records a second over ``LEDGER_ROUNDS`` rounds (module text)."""
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        ledger = Ledger(Path(tmp), epsilon_budget=1e9, delta=1e-5, accountant="rdp")
        event = Event(noise_multiplier=5.0, sample_rate=1.0, count=1, kind="release")
        no_op: Callable[[int], None] = lambda _fd: None  # noqa: E731
        with mock.patch("runtime.files.os.fsync", os.fsync if fsync else no_op):
            start = time.perf_counter()
            for round_ in range(LEDGER_ROUNDS):
                ledger.record(round_, [event])
            return LEDGER_ROUNDS / (time.perf_counter() - start)


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet.create(Path(tmp), BURST)
        clients = sorted(fleet.devices)
        updates = make_updates(BURST, round_=1, seed=3)
        payloads = [fleet.signed(u, c, RUN) for u, c in zip(updates, clients, strict=True)]
        topics = [update_topic(FLEET, c) for c in clients]
        worker: dict[str, list[float]] = {s: [] for s in SETTINGS}
        single: dict[str, list[float]] = {s: [] for s in SETTINGS}
        for _ in range(REPEATS):
            for setting in SETTINGS:
                print(f"  one worker, {setting}:", file=sys.stderr)
                worker[setting].append(drain(fleet, 1, payloads, topics, synchronous=setting).rate)
                single[setting].append(single_drain(fleet, setting, clients))
        ledger = {
            f: [ledger_rate(Path(tmp), fsync=f) for _ in range(REPEATS)] for f in (True, False)
        }
    med = {k: float(np.median(v)) for k, v in worker.items()}
    one = {k: float(np.median(v)) for k, v in single.items()}
    led = {k: float(np.median(v)) for k, v in ledger.items()}
    return {
        "coordinator.signed_updates_per_s_group": med["GROUP"],
        "coordinator.signed_group_over_normal": med["GROUP"] / med["NORMAL"],
        "coordinator.signed_single_updates_per_s_group": one["GROUP"],
        "coordinator.signed_single_group_over_normal": one["GROUP"] / one["NORMAL"],
        "coordinator.signed_updates_per_s_full": med["FULL"],
        "coordinator.signed_updates_per_s_normal": med["NORMAL"],
        "coordinator.signed_full_over_normal": med["FULL"] / med["NORMAL"],
        "coordinator.signed_single_updates_per_s_full": one["FULL"],
        "coordinator.signed_single_updates_per_s_normal": one["NORMAL"],
        "coordinator.signed_single_full_over_normal": one["FULL"] / one["NORMAL"],
        "agent.ledger_records_per_s_fsync": led[True],
        "agent.ledger_records_per_s_no_fsync": led[False],
    }


if __name__ == "__main__":
    for key, value in sorted(run().items()):
        print(f"{key}  {value:.4g}")
