"""Building blocks for coordinator tests: configs and stand-in client updates."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

from coordinator.config import CoordinatorConfig, ModelSettings, RoundSettings
from fleet.transports.broker import MosquittoBroker
from protocol import PrototypeUpdate, RoundAnnouncement, round_topic, update_topic
from runtime.security import CoordinatorSecurity
from runtime.transport import MqttSettings
from tests.mqtt_helpers import Collector, connected

BUNDLE = "f" * 64
CLASSES = ("a", "b", "c")
DIM = 4
BIN = Path(sys.executable).parent


def config(
    state_dir: Path,
    *,
    method: str = "fedpcl",
    port: int = 1883,
    feature_dim: int = 0,
    **rounds: object,
) -> CoordinatorConfig:
    return CoordinatorConfig(
        fleet="lab",
        state_dir=state_dir,
        model=ModelSettings(
            method=method, bundle=BUNDLE, classes=CLASSES, dim=DIM, feature_dim=feature_dim
        ),
        rounds=RoundSettings(**rounds),  # type: ignore[arg-type]
        mqtt=MqttSettings(port=port),
        # Signatures have their tests (test_signatures.py); these are about other things.
        security=CoordinatorSecurity(insecure=True),
    )


def stand_in_update(
    client: int, round_: int, *, method: str = "fedpcl", seed: int = 0
) -> PrototypeUpdate:
    """A deterministic update: client i holds classes {i % 3, (i + 1) % 3}."""
    rng = np.random.default_rng(1000 * seed + 17 * client + round_)
    classes = sorted({client % 3, (client + 1) % 3})
    z = rng.normal(size=(len(classes), DIM))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return PrototypeUpdate(
        fleet="lab",
        round=round_,
        client=f"dev-{client}",
        bundle=BUNDLE,
        method=method,
        classes=tuple(classes),
        counts=tuple(int(c) for c in rng.integers(1, 50, size=len(classes))),
        prototypes=z.astype(np.float16),
    )


def lower_median(values: list[float]) -> float:
    """The smaller middle value: what the coordinator's default caps are."""
    return sorted(values)[(len(values) - 1) // 2]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norms if norms > 0 else 0.0


def hand_globals(updates: list[PrototypeUpdate]) -> dict[int, np.ndarray]:
    """FedPCL's default global prototypes, computed the slow obvious way: each count capped
    at its class's lower median count (the stand-ins' unit rows are never clipped); then,
    per class, the rows whose cosine to the coordinate-wise median row is below half the
    holders' lower median cosine count for nothing (the direction screen)."""
    held: dict[int, list[float]] = {}
    rows: dict[int, list[np.ndarray]] = {}
    for u in updates:
        for c, n, p in zip(u.classes, u.counts, u.prototypes, strict=True):
            held.setdefault(c, []).append(n)
            rows.setdefault(c, []).append(p.astype(np.float64))
    bars: dict[int, float] = {}
    for c, class_rows in rows.items():
        centre = np.median(np.stack(class_rows), axis=0)
        typical = lower_median([_cosine(p, centre) for p in class_rows])
        bars[c] = 0.5 * typical if typical > 0 else -np.inf
    sums: dict[int, np.ndarray] = {}
    totals: dict[int, float] = {}
    for u in updates:
        for c, n, p in zip(u.classes, u.counts, u.prototypes, strict=True):
            p = p.astype(np.float64)
            centre = np.median(np.stack(rows[c]), axis=0)
            if _cosine(p, centre) < bars[c]:
                continue  # screened: as if the device had not reported the class
            n = min(n, lower_median(held[c]))
            sums[c] = sums.get(c, np.zeros(DIM)) + n * p
            totals[c] = totals.get(c, 0.0) + n
    return {c: sums[c] / totals[c] for c in sums}


def hand_fedavg(updates: list[PrototypeUpdate]) -> dict[str, np.ndarray]:
    """FedAvg's default average, the slow obvious way: each device's sample total capped at
    the lower median total, each array clipped to the lower median of its norms."""
    totals = [float(sum(u.counts)) for u in updates]
    weights = np.minimum(totals, lower_median(totals))
    out = {}
    for name in updates[0].extras:
        norms = [float(np.linalg.norm(u.extras[name])) for u in updates]
        bound = lower_median(norms)
        out[name] = sum(
            w / weights.sum() * min(1.0, bound / n) * u.extras[name].astype(np.float64)
            for w, n, u in zip(weights, norms, updates, strict=True)
        )
    return out


def coordinator_toml(
    tmp_path: Path,
    port: int,
    *,
    method: str = "fedpcl",
    clients: int = 3,
    rounds: int = 1,
    dim: int = DIM,
    feature_dim: int | None = None,
    state_dir: Path | None = None,
    allow_list: tuple[str, ...] = (),
    keys: Path | None = None,
) -> Path:
    """A coordinator config for fleet "lab" on ``port``, written to tmp_path; signed with
    ``keys`` (a folder holding coordinator.key and devices/) or else insecure."""
    lines = [
        'fleet = "lab"',
        f'state_dir = "{state_dir or tmp_path / "state"}"',
        "[model]",
        f'method = "{method}"',
        f'bundle = "{BUNDLE}"',
        'classes = ["a", "b", "c"]',
        f"dim = {dim}",
        *([f"feature_dim = {feature_dim}"] if feature_dim is not None else []),
        "[rounds]",
        f"min_clients = {clients}",
        "wait_after_quorum_s = 0.0",
        "timeout_s = 600.0",
        f"max_rounds = {rounds}",
        *([f"allow_list = [{', '.join(f'{c!r}' for c in allow_list)}]"] if allow_list else []),
        "[mqtt]",
        f"port = {port}",
        "[security]",
        *(
            [f'key = "{keys / "coordinator.key"}"', f'devices = "{keys / "devices"}"']
            if keys is not None
            # Signatures have their tests (test_signatures.py); these are about other things.
            else ["insecure = true"]
        ),
    ]
    path = tmp_path / "coordinator.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start(config: Path, *, log_level: str = "WARNING") -> subprocess.Popen[str]:
    """``edge-coordinator run`` as a process, its output piped."""
    return subprocess.Popen(
        [str(BIN / "edge-coordinator"), "--log-level", log_level, "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> None:
    """Wait for a coordinator that has run its last round: exit 0, no traceback."""
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr


class Fleet:
    """Stand-in clients: read announcements, publish prepared updates."""

    def __init__(self, inbox: Collector, pub: mqtt.Client) -> None:
        self.inbox, self.pub = inbox, pub

    def announcement(self, round_: int, *, timeout: float = 20.0) -> RoundAnnouncement:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            messages = self.inbox.wait(seen + 1, timeout=max(0.1, deadline - time.monotonic()))
            for m in messages[seen:]:
                a = RoundAnnouncement.from_wire(m.payload)
                if a.round == round_:
                    return a
            seen = len(messages)

    def run(self) -> str:
        """The run round 0's signed announcement names: what a device signs its updates for."""
        first = self.announcement(0)
        assert first.auth is not None, "round 0 was announced unsigned"
        return first.auth.run

    def send(self, updates: list[PrototypeUpdate]) -> None:
        for u in updates:
            self.publish(update_topic("lab", u.client), u.to_wire())

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish at QoS 1 and wait for the broker to take it."""
        self.pub.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)


@contextmanager
def stand_ins(broker: MosquittoBroker, client_id: str = "stand-ins") -> Iterator[Fleet]:
    """Stand-in clients connected to ``broker``, subscribed to fleet "lab"'s round topic."""
    with connected(broker.address, client_id, subscribe=(round_topic("lab"),)) as (pub, inbox):
        yield Fleet(inbox, pub)
