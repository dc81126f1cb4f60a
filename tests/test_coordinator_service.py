"""The coordinator as a real process against a real Mosquitto, with stand-in clients."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.service.service import RECONNECT_MAX_S, CoordinatorService
from coordinator.storage.store import Store
from fleet.transports.broker import MosquittoBroker, free_port
from protocol import PrototypeUpdate, RoundAnnouncement, round_topic, update_topic
from protocol.topics import receipt_topic
from tests.coordinator_helpers import (
    Fleet,
    coordinator_toml,
    hand_globals,
    stand_in_update,
    stand_ins,
    start,
)
from tests.coordinator_helpers import config as service_config
from tests.fuzz_corpus import payloads
from tests.mqtt_helpers import connected
from tests.process_helpers import coordinator_process, status

pytestmark = pytest.mark.broker

BIN = Path(sys.executable).parent
CLIENTS = 5


ALLOW = tuple(f"dev-{i}" for i in range(CLIENTS))


def write_config(tmp_path: Path, port: int, *, rounds: int) -> Path:
    return coordinator_toml(tmp_path, port, clients=CLIENTS, rounds=rounds, allow_list=ALLOW)


def wait_until(
    predicate: Callable[[], bool], *, timeout: float = 20.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)  # poll interval of a bounded wait on another process's state


def stored_updates(tmp_path: Path, round_: int) -> int:
    db = tmp_path / "state" / "coordinator.sqlite3"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as conn:
        try:
            return int(
                conn.execute("SELECT COUNT(*) FROM updates WHERE round = ?", (round_,)).fetchone()[
                    0
                ]
            )
        except sqlite3.OperationalError:
            return 0


def run_rounds(fleet: Fleet, rounds: int, *, seed: int = 0) -> list[RoundAnnouncement]:
    published = []
    for r in range(rounds):
        fleet.announcement(r)
        ups = [stand_in_update(i, r, seed=seed) for i in range(CLIENTS)]
        fleet.send(ups)
        nxt = fleet.announcement(r + 1)
        expected = hand_globals(ups)
        assert nxt.global_classes == tuple(sorted(expected))
        for row, c in zip(nxt.global_prototypes, nxt.global_classes, strict=True):
            np.testing.assert_allclose(row, expected[c], rtol=1e-5, atol=1e-6)
        published.append(nxt)
    return published


@pytest.mark.slow
def test_five_fedpcl_rounds_match_a_hand_computation(mosquitto, tmp_path):
    config = write_config(tmp_path, mosquitto.address.port, rounds=5)
    proc = start(config)
    try:
        with stand_ins(mosquitto) as fleet:
            final = run_rounds(fleet, 5)[-1]
        assert final.round == 5 and final.params["final"] is True
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        # Leaving after the final round is not a lost connection.
        assert "disconnected" not in stderr
    finally:
        proc.kill()
    summary = status("edge-coordinator", config)
    assert summary["rounds_completed"] == 6  # five aggregated rounds and the closed final one
    assert summary["rejections"] == {}


@pytest.mark.slow
def test_sigkill_between_updates_ends_with_the_same_globals(mosquitto, tmp_path):
    # Reference: an uninterrupted run of two rounds in its own fleet state.
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    proc = start(write_config(ref_dir, mosquitto.address.port, rounds=2))
    with stand_ins(mosquitto, "stand-ins-ref") as fleet:
        reference = run_rounds(fleet, 2)
    assert proc.wait(timeout=30) == 0
    # The broker keeps the reference run's retained final announcement; clear it.
    with connected(mosquitto.address, "cleaner") as (pub, _):
        pub.publish(round_topic("lab"), b"", qos=1, retain=True).wait_for_publish(10)

    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    config = write_config(crash_dir, mosquitto.address.port, rounds=2)
    proc = start(config)
    with stand_ins(mosquitto) as fleet:
        fleet.announcement(0)
        ups = [stand_in_update(i, 0) for i in range(CLIENTS)]
        fleet.send(ups[:2])
        wait_until(lambda: stored_updates(crash_dir, 0) == 2, what="two stored updates")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc = start(config)
        # QoS 1 redelivery: the first two arrive again after the restart.
        fleet.send(ups)
        first = fleet.announcement(1)
        fleet.send([stand_in_update(i, 1) for i in range(CLIENTS)])
        second = fleet.announcement(2)
    assert proc.wait(timeout=30) == 0
    for got, want in zip((first, second), reference, strict=True):
        assert got.global_classes == want.global_classes
        np.testing.assert_array_equal(got.global_prototypes, want.global_prototypes)
        assert got.local_sets.keys() == want.local_sets.keys()
    # Two re-sent updates are duplicates; the broker may also redeliver the one whose
    # PUBACK the killed process never sent (QoS 1): that copy is a duplicate too.
    rejections = status("edge-coordinator", config)["rejections"]
    assert set(rejections) == {"duplicate"} and 2 <= rejections["duplicate"] <= 4, rejections


@pytest.mark.slow
def test_malformed_updates_over_mqtt_are_rejected_and_counted(mosquitto, tmp_path):
    valid = [stand_in_update(0, 0).to_wire()]
    malformed = []
    for payload in payloads(valid, count=10_000, seed=21):
        try:
            PrototypeUpdate.from_wire(payload)
        except ValueError:
            malformed.append(payload)
    assert len(malformed) > 5_000
    config = write_config(tmp_path, mosquitto.address.port, rounds=1)
    proc = start(config)
    try:
        with stand_ins(mosquitto) as fleet:
            fleet.announcement(0)
            infos = [fleet.pub.publish(update_topic("lab", "dev-0"), p, qos=1) for p in malformed]
            for info in infos:
                info.wait_for_publish(30)
            fleet.send([stand_in_update(i, 0) for i in range(CLIENTS)])
            final = fleet.announcement(1, timeout=60)
        assert final.global_classes == (0, 1, 2)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    rejections = status("edge-coordinator", config)["rejections"]
    assert sum(rejections.values()) == len(malformed)
    assert set(rejections) <= {"malformed", "field", "array", "id", "version", "too_large"}


@pytest.mark.slow
def test_a_coordinator_started_before_its_broker_says_so_and_announces_once_it_is_up(tmp_path):
    port = free_port()
    coordinator = coordinator_process(write_config(tmp_path, port, rounds=1))
    try:
        coordinator.wait_for(
            f"cannot reach the broker at 127.0.0.1:{port} (Connection refused); retrying"
        )
        with (
            MosquittoBroker(port=port) as broker,
            connected(broker.address, "watch", subscribe=(round_topic("lab"),)) as (_, inbox),
        ):
            # paho's own backoff: the first retries come within a few seconds.
            message = inbox.wait(1, timeout=30)[0]
            assert RoundAnnouncement.from_wire(message.payload).round == 0
            assert coordinator.stop() == 0
    finally:
        coordinator.close()


@pytest.mark.slow
def test_a_second_coordinator_on_the_same_database_is_refused(tmp_path):
    # No broker is needed: the first holds the lock from before its first connection.
    config = write_config(tmp_path, free_port(), rounds=3)
    first = coordinator_process(config)
    try:
        seen = first.wait_for("started run")  # a new database: the first run begins
        first.wait_for("cannot reach the broker", after=seen)  # serving: stops cleanly
        second = subprocess.run(
            [str(BIN / "edge-coordinator"), "run", "--config", str(config)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == 2
        database = tmp_path / "state" / "coordinator.sqlite3"
        assert second.stderr.strip().splitlines() == [
            f"edge-coordinator: error: coordinator database {database} is in use by another "
            f"process (pid {first.proc.pid}); stop that one first"
        ]
        assert status("edge-coordinator", config)["running_pid"] == first.proc.pid
        assert first.stop() == 0
        assert status("edge-coordinator", config)["running_pid"] is None
    finally:
        first.close()
    # The lock went with its holder: a new coordinator starts, on the same round.
    again = coordinator_process(config)
    try:
        seen = again.wait_for("resuming at round 0")
        again.wait_for("cannot reach the broker", after=seen)  # serving: stops cleanly
        assert again.stop() == 0
    finally:
        again.close()


def service(tmp_path: Path, **rounds: Any) -> CoordinatorService:
    """A coordinator service on a fresh database, never started (no broker needed)."""
    cfg = service_config(tmp_path, **rounds)
    return CoordinatorService(
        manager=RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics())
    )


def update_message(update: PrototypeUpdate) -> mqtt.MQTTMessage:
    """An update as paho hands it to the link: on its device's topic, QoS 1."""
    message = mqtt.MQTTMessage(mid=7, topic=update_topic("lab", update.client).encode())
    message.qos, message.payload = 1, update.to_wire()
    return message


def test_the_coordinator_retries_a_lost_broker_every_few_seconds_at_most(tmp_path):
    # paho doubles its delay up to mqtt.reconnect_max_s (60 s by default): after a long
    # outage the coordinator came back up to a minute after the broker.
    coordinator = service(tmp_path)
    assert coordinator.config.mqtt.reconnect_max_s == 60.0
    client = coordinator.link.client
    assert (client._reconnect_min_delay, client._reconnect_max_delay) == (1, RECONNECT_MAX_S)
    assert RECONNECT_MAX_S == 5.0
    coordinator.manager.store.close()


def test_an_updates_receipt_is_queued_before_the_round_loop_is_woken(tmp_path, monkeypatch):
    """Woken first, the loop could close the round and announce the next one before the
    receipt left, and the device would hear its round closed before its update stored
    (seen in tests/test_deploy.py on a loaded machine). The order is pinned here by
    recording, for each publish, whether the loop had been woken yet (at FULL, where the
    receipt is published on paho's thread at once)."""
    cfg = replace(service_config(tmp_path, min_clients=1, wait_after_quorum_s=0.0),
                  sqlite_synchronous="FULL")  # fmt: skip
    coordinator = CoordinatorService(
        manager=RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics())
    )
    published: list[tuple[str, bool]] = []

    def publish(topic: str, payload: bytes, *, retain: bool = False) -> None:
        published.append((topic, coordinator._wake.is_set()))

    monkeypatch.setattr(coordinator.link, "publish", publish)
    update = stand_in_update(0, 0)
    assert coordinator._on_message(update_message(update))  # stored: the link acknowledges
    assert published == [(receipt_topic("lab", update.client), False)]
    assert coordinator._wake.is_set()
    coordinator.manager.store.close()


def test_under_group_commit_the_receipt_goes_out_before_the_close_it_preceded(
    tmp_path, monkeypatch
):
    # GROUP (the default) holds the receipt for an fsync of the log; the round's close
    # waits for one too, and the receipts queued before it go out first.
    coordinator = service(tmp_path, min_clients=1, wait_after_quorum_s=0.0)
    assert coordinator.config.sqlite_synchronous == "GROUP"
    published: list[str] = []
    monkeypatch.setattr(coordinator.link, "publish",
                        lambda topic, payload, *, retain=False: published.append(topic))  # fmt: skip
    update = stand_in_update(0, 0)
    assert coordinator._on_message(update_message(update))
    coordinator._step()  # the quorum of 1 is met: the round closes and round 1 is announced
    assert published[:2] == [receipt_topic("lab", update.client), round_topic("lab")]
    assert coordinator.manager.round == 1
    assert coordinator._sync is not None
    coordinator._sync.close()
    coordinator.manager.store.close()


def test_an_update_that_cannot_be_stored_is_left_unacknowledged(tmp_path):
    # Acknowledged only once committed: the broker delivers it again after the restart
    # that the storage fault brings (runtime/mqtt_link.py acknowledges a True only).
    coordinator = service(tmp_path, min_clients=1)
    coordinator.manager.store.close()  # every write now fails, as on a full disk
    assert not coordinator._on_message(update_message(stand_in_update(0, 0)))
    assert coordinator._fault is not None and coordinator._wake.is_set()
    # Intake has stopped: later messages are left for the next start, unread.
    assert not coordinator._on_message(update_message(stand_in_update(1, 0)))
