"""Reliability benchmarks: how fast a real coordinator behind a real Mosquitto rejects junk,
whether a junk flood during a round loses an honest update, and a 200-client MQTT fleet
run that writes its report.

- ``reliability.junk_drain_per_s``: malformed update messages a coordinator rejects per
  second. The coordinator is paused (SIGSTOP) while the broker queues a burst for it, then
  resumed; the figure is the burst over the time until its metrics count every message.
  ``reliability.paho_drain_per_s`` is the same burst drained by paho's own client doing
  nothing with it (one packet per ``select()``), measured beside it; the coordinator
  reads through ``runtime.bulkread`` and ``junk_drain_over_paho`` is what that buys.
- ``reliability.flood_honest_lost``: devices (real agents) whose round-0 update never
  reached the round when 20,000 junk messages are published while they answer it.
- ``fleet.mqtt_200_round_s``: median round time of ``edge-fleet run --transport mqtt
  --clients 200`` (small zoo), which must finish with its report.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

from export import bundle as bundle_mod
from fleet.data.digits5 import domain_data
from fleet.transports.broker import BrokerAddress, MosquittoBroker, free_port
from protocol import round_topic, update_filter, update_topic

BIN = Path(sys.executable).parent
BUNDLE = "e" * 64
#: Below the shipped broker's max_queued_messages (10,000): the whole burst waits for the
#: paused coordinator, none of it is dropped.
BURST = 9_500


def _rejected(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("protofleet_updates_rejected_total{")
    )


def publish_burst(
    address: BrokerAddress, topics: list[str], payloads: list[bytes], *, client_id: str
) -> None:
    """Publish every payload (QoS 1) as fast as the broker takes them."""
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    pub.max_inflight_messages_set(1000)
    pub.connect(address.host, address.port)
    pub.loop_start()
    try:
        infos = [pub.publish(t, p, qos=1) for t, p in zip(topics, payloads, strict=True)]
        for info in infos:
            info.wait_for_publish(120)
    finally:
        pub.loop_stop()
        pub.disconnect()


def _wait(predicate, *, timeout: float, what: str, every: float = 0.005) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} in {timeout:.0f} s")
        time.sleep(every)  # poll interval of a bounded wait on another process


def paho_drain_per_s(broker: MosquittoBroker, junk: list[bytes], topics: list[str]) -> float:
    """The same burst drained by paho's own client doing nothing with it: the most a
    consumer reading one packet at a time reaches on this machine."""
    count = [0]
    done = threading.Event()

    def on_message(_c: object, _u: object, _m: object) -> None:
        count[0] += 1
        if count[0] >= len(junk):
            done.set()

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-bare", clean_session=False)
    sub.on_message = on_message
    subscribed = threading.Event()
    sub.on_subscribe = lambda *_: subscribed.set()
    sub.connect(broker.address.host, broker.address.port)
    sub.loop_start()
    sub.subscribe(update_filter("bench"), qos=1)
    subscribed.wait(30)
    sub.loop_stop()
    sub.disconnect()  # the persistent session queues the burst meanwhile
    publish_burst(broker.address, topics, junk, client_id="bench-junk-bare")
    sub.connect(broker.address.host, broker.address.port)
    start = time.perf_counter()
    sub.loop_start()
    if not done.wait(300):
        raise TimeoutError("the bare client did not drain the burst")
    elapsed = time.perf_counter() - start
    sub.loop_stop()
    sub.disconnect()
    return len(junk) / elapsed


def junk_drain_per_s(repeats: int = 3) -> tuple[float, float]:
    """(coordinator, bare paho client) messages drained per second, medians."""
    rng = np.random.default_rng(0)
    junk = [rng.bytes(int(n)) for n in rng.integers(1, 400, size=BURST)]
    topics = [update_topic("bench", f"junk-{i % 50}") for i in range(BURST)]
    rates = []
    with tempfile.TemporaryDirectory() as tmp, MosquittoBroker() as broker:
        metrics_port = free_port()
        config = Path(tmp) / "c.toml"
        config.write_text(
            f'fleet = "bench"\nstate_dir = "{tmp}/state"\n[model]\nbundle = "{BUNDLE}"\n'
            "[rounds]\nmin_clients = 1\ntimeout_s = 3600.0\n"
            f"[mqtt]\nport = {broker.address.port}\n[metrics]\nport = {metrics_port}\n"
            "[security]\ninsecure = true\n"  # junk fails before any signature check
        )
        proc = subprocess.Popen(
            [str(BIN / "edge-coordinator"), "--log-level", "ERROR", "run", "--config", str(config)]
        )
        try:
            announced: list[bytes | bytearray] = []
            watch = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-watch")
            watch.on_message = lambda _c, _u, m: announced.append(m.payload)
            watch.connect(broker.address.host, broker.address.port)
            watch.subscribe(round_topic("bench"), qos=1)
            watch.loop_start()
            _wait(lambda: bool(announced), timeout=60, what="announcement")
            watch.loop_stop()
            watch.disconnect()
            for r in range(repeats):
                before = _rejected(metrics_port)
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    publish_burst(broker.address, topics, junk, client_id=f"bench-junk-{r}")
                finally:
                    start = time.perf_counter()
                    os.kill(proc.pid, signal.SIGCONT)
                _wait(
                    lambda b=before: _rejected(metrics_port) - b >= BURST,
                    timeout=120,
                    what="drained burst",
                    every=0.05,  # a scrape costs the coordinator CPU: not too often
                )
                rates.append(BURST / (time.perf_counter() - start))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        bare = [paho_drain_per_s(broker, junk, topics) for _ in range(repeats)]
    return float(np.median(rates)), float(np.median(bare))


@contextlib.contextmanager
def small_zoo() -> Iterator[Path]:
    """The small zoo exported afresh by ``edge-export zoo`` into a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="protofleet-zoo-") as tmp:
        bundle = Path(tmp) / "zoo"
        subprocess.run(
            [str(BIN / "edge-export"), "zoo", "--out", str(bundle), "--size", "small"],
            check=True, capture_output=True, timeout=1800,
        )  # fmt: skip
        yield bundle


def agent_config(
    root: Path, name: str, domain: str, *, bundle: Path, port: int, samples: int, epochs: int
) -> Path:
    """An insecure agent's config in ``root`` on ``samples`` images of digits-5 ``domain``,
    re-sending after 1 s."""
    x, y = domain_data(domain, indices=np.arange(samples))
    train = root / f"{name}.npz"
    np.savez(train, x=(x * 255).astype(np.uint8), y=y)
    cfg = root / f"{name}.toml"
    cfg.write_text(
        f'agent_id = "{name}"\nfleet = "lab"\nstate_dir = "{root / name}"\n'
        f'bundle = "{bundle}"\n[data]\ntrain = "{train}"\n[train]\nout_dim = 32\n'
        f"epochs = {epochs}\n[mqtt]\nport = {port}\nresend_s = 1.0\n[security]\ninsecure = true\n"
    )
    return cfg


def flood_honest_lost(bundle: Path, clients: int = 3) -> int:
    """Run the junk flood of tests/test_hostile.py with ``clients`` real agents."""
    bundle_id = bundle_mod.load(bundle).id
    rng = np.random.default_rng(7)
    junk = [rng.bytes(int(n)) for n in rng.integers(1, 400, size=20_000)]
    topics = [update_topic("lab", f"junk-{i % 50}") for i in range(len(junk))]
    domains = ("clean", "inverted", "colour", "photo", "blur")
    with tempfile.TemporaryDirectory() as tmp, MosquittoBroker() as broker:
        root = Path(tmp)
        port = broker.address.port
        config = root / "coordinator.toml"
        config.write_text(
            f'fleet = "lab"\nstate_dir = "{root / "state"}"\n[model]\nbundle = "{bundle_id}"\n'
            f"dim = 32\n[rounds]\nmin_clients = {clients}\nwait_after_quorum_s = 0.0\n"
            f"timeout_s = 600.0\nmax_rounds = 1\n[mqtt]\nport = {port}\n"
            "[security]\ninsecure = true\n"
        )
        agent_configs = [
            agent_config(root, f"dev-{i}", domains[i % len(domains)], bundle=bundle, port=port,
                         samples=200, epochs=3)
            for i in range(clients)
        ]  # fmt: skip
        logs = [root / f"dev-{i}.log" for i in range(clients)]
        coordinator = subprocess.Popen(
            [str(BIN / "edge-coordinator"), "--log-level", "ERROR", "run", "--config", str(config)]
        )
        agents = [
            subprocess.Popen(
                [str(BIN / "edge-agent"), "run", "--config", str(cfg)],
                stderr=log.open("wb"),
                stdout=subprocess.DEVNULL,
            )
            for cfg, log in zip(agent_configs, logs, strict=True)
        ]
        try:
            _wait(
                lambda: "round 0: training" in logs[0].read_text(),
                timeout=300,
                what="training agent",
            )
            publish_burst(broker.address, topics, junk, client_id="bench-junk")
            with contextlib.suppress(TimeoutError):  # a lost update: counted below
                _wait(lambda: coordinator.poll() is not None, timeout=300, what="closed round")
            stored = sum(
                "round 0: update stored by the coordinator" in log.read_text() for log in logs
            )
        finally:
            for proc in (*agents, coordinator):
                if proc.poll() is None:
                    proc.terminate()
            for proc in (*agents, coordinator):
                proc.wait(timeout=60)
        return clients - stored


def mqtt_200_round_s(bundle: Path) -> float:
    """``edge-fleet run --transport mqtt --clients 200``: the median round, from its report."""
    with tempfile.TemporaryDirectory(prefix="protofleet-200-") as tmp:
        out = Path(tmp) / "run"
        result = subprocess.run(
            [str(BIN / "edge-fleet"), "run", "--transport", "mqtt", "--clients", "200",
             "--rounds", "3", "--train", "20", "--test", "20", "--bundle", str(bundle),
             "--out", str(out), "--no-progress"],
            capture_output=True, text=True, timeout=3 * 3600,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"edge-fleet run failed: {result.stderr[-2000:]}")
        report = next(out.rglob("report.json"))
        seconds = _round_seconds(json.loads(report.read_text()))
    return float(np.median(seconds))


def _round_seconds(report: object) -> list[float]:
    """Every ``round_seconds`` list in a report, flattened (one run: one list)."""
    found: list[float] = []
    if isinstance(report, dict):
        for key, value in report.items():
            if key == "round_seconds" and isinstance(value, list):
                found += [float(v) for v in value if v is not None]
            else:
                found += _round_seconds(value)
    elif isinstance(report, list):
        for value in report:
            found += _round_seconds(value)
    return found


def run() -> dict[str, float]:
    drained, bare = junk_drain_per_s()
    out: dict[str, float] = {
        "reliability.junk_drain_per_s": drained,
        "reliability.paho_drain_per_s": bare,
        "reliability.junk_drain_over_paho": drained / bare,
    }
    with small_zoo() as bundle:
        out["reliability.flood_honest_lost"] = float(flood_honest_lost(bundle))
        out["fleet.mqtt_200_round_s"] = mqtt_200_round_s(bundle)
    return out
