"""Coordinator benchmarks: aggregation of 10,000 updates, and sustained update intake
from publishers through a real Mosquitto into the coordinator's SQLite database."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

from coordinator.config import CoordinatorConfig, ModelSettings, RoundSettings
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import Store
from coordinator.storage.store_reader import StoreReader
from coordinator.strategies import make_strategy
from fleet.transports.broker import MosquittoBroker
from protocol import PrototypeUpdate, round_topic, update_topic
from runtime.security import CoordinatorSecurity

CLASSES, DIM, BUNDLE = 10, 256, "e" * 64


def make_updates(n: int, *, round_: int = 0, seed: int = 0) -> list[PrototypeUpdate]:
    rng = np.random.default_rng(seed)
    # Eight "domains" of clients so FINCH has real structure to find.
    centres = rng.normal(size=(8, CLASSES, DIM))
    out = []
    for i in range(n):
        z = centres[i % 8] + 0.3 * rng.normal(size=(CLASSES, DIM))
        z /= np.linalg.norm(z, axis=1, keepdims=True)
        out.append(
            PrototypeUpdate(
                fleet="bench",
                round=round_,
                client=f"dev-{i:05d}",
                bundle=BUNDLE,
                method="fedpcl",
                classes=tuple(range(CLASSES)),
                counts=tuple(int(c) for c in rng.integers(1, 100, size=CLASSES)),
                prototypes=z.astype(np.float16),
            )
        )
    return out


def time_aggregation(
    method: str, updates: list[PrototypeUpdate], *, repeat: int = 3
) -> tuple[float, float]:
    """(first call, median of ``repeat`` calls) in seconds. The first call of a process
    also pays for faulting in a few hundred MB of fresh memory; a long-running
    coordinator is in the steady state the median shows."""
    strategy = make_strategy(method)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        strategy.aggregate(updates, num_classes=CLASSES, dim=DIM)
        times.append(time.perf_counter() - start)
    return times[0], float(np.median(times))


def intake_rate(count: int = 5_000) -> tuple[float, float]:
    """Updates per second from publish to durable row, and the same with no consumer
    (publish to broker only) for comparison."""
    payloads = [u.to_wire() for u in make_updates(count, seed=1)]
    with tempfile.TemporaryDirectory() as tmp, MosquittoBroker() as broker:
        config = Path(tmp) / "c.toml"
        config.write_text(
            f'fleet = "bench"\nstate_dir = "{tmp}/state"\n'
            f'[model]\nbundle = "{BUNDLE}"\n'
            f"[rounds]\nmin_clients = {count + 1}\ntimeout_s = 3600.0\n"
            f"[mqtt]\nport = {broker.address.port}\n"
            # Unsigned stand-in updates: the figure stays comparable with earlier runs.
            "[security]\ninsecure = true\n"
        )
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "edge-coordinator"),
                "--log-level",
                "ERROR",
                "run",
                "--config",
                str(config),
            ]
        )
        db = Path(tmp) / "state" / "coordinator.sqlite3"
        try:
            pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-publisher")
            pub.max_inflight_messages_set(1000)
            # The coordinator subscribes before it publishes its retained announcement,
            # and the broker handles one client's packets in order: once the
            # announcement arrives, the coordinator's subscription is in place.
            announced = threading.Event()
            pub.on_message = lambda _c, _u, _m: announced.set()
            pub.connect(broker.address.host, broker.address.port)
            pub.subscribe(round_topic("bench"), qos=1)
            pub.loop_start()
            if not announced.wait(60):
                raise TimeoutError("the coordinator never announced a round")
            start = time.perf_counter()
            infos = [
                pub.publish(update_topic("bench", f"dev-{i:05d}"), p, qos=1)
                for i, p in enumerate(payloads)
            ]
            for info in infos:
                info.wait_for_publish(60)
            published = time.perf_counter() - start
            _wait(lambda: _rows(db) >= count, timeout=120)
            stored = time.perf_counter() - start
            pub.loop_stop()
            pub.disconnect()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return count / stored, count / published


def database_mb(*, clients: int, rounds: int, keep_rounds: int) -> float:
    """Size of the coordinator's database after ``rounds`` FedPCL rounds of ``clients``
    updates each, driven through the real round manager and SQLite store."""
    now = [0.0]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = CoordinatorConfig(
            fleet="bench",
            state_dir=Path(tmp),
            model=ModelSettings(bundle=BUNDLE, classes=tuple(map(str, range(CLASSES))), dim=DIM),
            rounds=RoundSettings(
                min_clients=clients, wait_after_quorum_s=0.0, keep_rounds=keep_rounds
            ),
            security=CoordinatorSecurity(insecure=True),
        )
        store = Store(cfg.database)
        manager = RoundManager(config=cfg, store=store, metrics=Metrics(), clock=lambda: now[0])
        base = make_updates(clients, seed=2)
        for r in range(rounds):
            for u in base:
                manager.offer(dataclasses.replace(u, fleet="bench", round=r).to_wire())
            now[0] += 1.0
            if manager.poll() is None:
                raise RuntimeError(f"round {r} did not close")
        store.close()  # checkpoints the WAL into the main file
        return sum(f.stat().st_size for f in Path(tmp).glob("coordinator.sqlite3*")) / 1e6


def _rows(db: Path) -> int:
    if not db.exists():
        return 0  # the coordinator has not created it yet
    with StoreReader(db) as store:
        return store.update_count()


def _wait(predicate, *, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        time.sleep(0.02)


def run() -> dict[str, float]:
    updates = make_updates(10_000)
    results = {}
    for method in ("fedpcl", "fedproto", "fpl", "feddbp"):
        cold, steady = time_aggregation(method, updates)
        results[f"coordinator.aggregate_10k_{method}_s"] = steady
        results[f"coordinator.aggregate_10k_{method}_first_call_s"] = cold
    start = time.perf_counter()
    payloads = [u.to_wire() for u in updates]
    for p in payloads:
        PrototypeUpdate.from_wire(p)
    results["coordinator.decode_10k_s"] = time.perf_counter() - start
    # A long-running service: every round's payloads kept, against the default retention.
    everything = database_mb(clients=100, rounds=150, keep_rounds=0)
    retained = database_mb(clients=100, rounds=150, keep_rounds=25)
    results["coordinator.db_mb_100_clients_150_rounds_keep_all"] = everything
    results["coordinator.db_mb_100_clients_150_rounds_keep_25"] = retained
    results["coordinator.db_keep_all_over_keep_25"] = everything / retained
    stored, published = intake_rate()
    results["coordinator.updates_per_s"] = stored
    results["coordinator.publish_only_per_s"] = published
    return results
