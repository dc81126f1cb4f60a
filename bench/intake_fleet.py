"""The fleet the intake benchmark (bench/intake_bench.py) runs against: a real Mosquitto,
a signed coordinator configuration with enrolled devices, and worker processes started,
waited for, measured and stopped."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from bench.coordinator_bench import BUNDLE, CLASSES, DIM
from bench.reliability_bench import _wait
from fleet.transports.broker import BrokerAddress
from protocol import PrototypeUpdate
from protocol.auth import Signer, sign
from runtime.keyfiles import generate_ed25519, load_signer

BIN = Path(sys.executable).parent


FLEET = "bench"
#: Honest devices: the round quorum.
HONEST = 5


WORKERS = ("w1", "w2")


#: Enrolled devices the junk claims to be (each junk message fails its signature check).
BYSTANDERS = 50


#: The drain's run id, in the announcement the bench itself signs (no owner runs then).
RUN = "run-bench"


@dataclasses.dataclass
class Fleet:
    """Signed fleet ``bench`` in ``root``: the coordinator's key and ``devices`` enrolled
    devices (dev-00000 ...), whose signers stay in memory."""

    root: Path
    coordinator: Signer
    devices: dict[str, Signer]

    @classmethod
    def create(cls, root: Path, devices: int) -> Fleet:
        generate_ed25519(root / "coordinator.key", root / "coordinator.pub")
        enrolled = root / "devices"
        enrolled.mkdir(parents=True)
        signers = {f"dev-{i:05d}": _enrolled(enrolled / f"dev-{i:05d}.pub") for i in range(devices)}
        return cls(root, load_signer(root / "coordinator.key"), signers)

    def config(
        self,
        port: int,
        state: Path,
        *,
        rounds: int = 2,
        quorum: int = HONEST,
        synchronous: str | None = None,
        workers: bool = True,
    ) -> Path:
        """A coordinator TOML naming both workers, for the round owner and each worker
        (``workers=False``: a single coordinator's); ``synchronous`` sets
        ``sqlite_synchronous`` (None: the default)."""
        path = state.with_suffix(".toml")
        sync = "" if synchronous is None else f'sqlite_synchronous = "{synchronous}"\n'
        tier = (
            f'[workers]\nnames = {json.dumps(list(WORKERS))}\nlocal_sets = "omit"\n'
            "collect_retry_s = 1.0\n"
        )
        path.write_text(
            f'fleet = "{FLEET}"\nstate_dir = "{state}"\n{sync}'
            f'[model]\nmethod = "fedpcl"\nbundle = "{BUNDLE}"\n'
            f"classes = {json.dumps([str(c) for c in range(CLASSES)])}\ndim = {DIM}\n"
            f"[rounds]\nmin_clients = {quorum}\nwait_after_quorum_s = 0.0\n"
            f"timeout_s = 600.0\nmax_rounds = {rounds}\n"
            f"[mqtt]\nport = {port}\n"
            f'[security]\nkey = "{self.root / "coordinator.key"}"\n'
            f'devices = "{self.root / "devices"}"\n'
            # What the round owner requires (coordinator/tier/owner.py::refusal).
            "[robust]\nmedian_count_cap = false\nmedian_norm_clip = false\n"
            "median_direction_screen = false\n" + (tier if workers else "")
        )
        return path

    def signed(self, update: PrototypeUpdate, client: str, run: str) -> bytes:
        return sign(
            dataclasses.replace(update, client=client), self.devices[client], run=run
        ).to_wire()


def _enrolled(public: Path) -> Signer:
    """A fresh Ed25519 device key, its public half written to ``public`` (enrolment)."""
    key = ed25519.Ed25519PrivateKey.generate()
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return Signer(key)


def publish_one(address: BrokerAddress, topic: str, payload: bytes, *, retain: bool) -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-one")
    client.connect(address.host, address.port)
    client.loop_start()
    try:
        client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(30)
    finally:
        client.loop_stop()
        client.disconnect()


def start_workers(config: Path, names: tuple[str, ...]) -> list[subprocess.Popen[bytes]]:
    logs = [config.parent / f"{config.stem}-{name}.log" for name in names]
    return [
        subprocess.Popen(
            [str(BIN / "edge-coordinator"), "worker", "--config", str(config), "--name", name],
            stdout=subprocess.DEVNULL,
            stderr=log.open("ab"),
        )
        for name, log in zip(names, logs, strict=True)
    ]


def wait_ready(config: Path, names: tuple[str, ...], *, timeout: float = 60.0) -> None:
    for name in names:
        log = config.parent / f"{config.stem}-{name}.log"
        _wait(lambda log=log, name=name: f"worker {name} ready" in log.read_text(),
              timeout=timeout, what=f"ready worker {name}", every=0.05)  # fmt: skip


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, as systemd stops a worker: it disconnects, its session stays."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used (Linux /proc; 0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stored_rows(state: Path) -> int:
    total = 0
    for db in state.glob("worker-*.sqlite3"):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            total += int(conn.execute("SELECT COUNT(*) FROM updates").fetchone()[0])
    return total
