"""The round topic holds the coordinator's current announcement, not an earlier one of its
own published again (a replay, signed and well-formed) nor anything else retained over it;
over a real Mosquitto."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec as ec_keys
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from coordinator.config import CoordinatorConfig, RoundSettings
from coordinator.rounds import RoundManager
from coordinator.service.service import CoordinatorService
from coordinator.storage.store import Store
from fleet.transports.broker import MosquittoBroker
from protocol import RoundAnnouncement, round_topic
from protocol.auth import sign
from runtime.keyfiles import generate_ed25519, load_signer
from runtime.security import CoordinatorSecurity
from tests.coordinator_helpers import config as base_config
from tests.coordinator_helpers import stand_in_update, stand_ins
from tests.mqtt_helpers import Collector, connected

pytestmark = pytest.mark.broker


def signed_config(tmp_path: Path, port: int, *, ec: bool = False) -> CoordinatorConfig:
    """A signed fleet of one device; ``ec``: the coordinator signs with EC P-256, whose
    signatures differ at every signing (Ed25519's do not)."""
    devices = tmp_path / "devices"
    devices.mkdir()
    generate_ed25519(tmp_path / "coordinator.key", tmp_path / "coordinator.pub")
    if ec:
        key = ec_keys.generate_private_key(ec_keys.SECP256R1())
        (tmp_path / "coordinator.key").write_bytes(
            key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        )
    generate_ed25519(tmp_path / "dev-0.key", devices / "dev-0.pub")
    return dataclasses.replace(
        base_config(tmp_path / "state", port=port),
        rounds=RoundSettings(min_clients=1, wait_after_quorum_s=0.0, timeout_s=600.0),
        security=CoordinatorSecurity(key=tmp_path / "coordinator.key", devices=devices),
    )


@contextmanager
def serving(config: CoordinatorConfig, *, reassert_s: float = 1.0) -> Iterator[RoundManager]:
    """The coordinator service in a thread of this process, until the block ends."""
    manager = RoundManager(config=config, store=Store(config.database))
    service = CoordinatorService(manager=manager, exit_when_done=False)
    service.REASSERT_S = reassert_s
    ready = threading.Event()
    thread = threading.Thread(target=service.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    try:
        assert ready.wait(10), "the coordinator did not connect"
        yield manager
    finally:
        service.stop()
        thread.join(timeout=10)
        manager.store.close()
    assert not thread.is_alive()


def rejections(config: CoordinatorConfig) -> dict[str, int]:
    with sqlite3.connect(config.database) as db:
        return dict(db.execute("SELECT reason, count FROM rejections").fetchall())


def wait_for(inbox: Collector, payload: bytes, *, after: int = 0) -> list[bytes]:
    """The payloads on the round topic from index ``after`` up to the first ``payload``."""
    seen = after
    while True:
        got = [bytes(m.payload) for m in inbox.wait(seen + 1)[after:]]
        if payload in got:
            return got[: got.index(payload) + 1]
        seen = after + len(got)


def retained(broker: MosquittoBroker, client_id: str) -> bytes:
    """What a device connecting now gets first on the round topic."""
    with connected(broker.address, client_id, subscribe=(round_topic("lab"),)) as (_, inbox):
        return bytes(inbox.wait(1)[0].payload)


@pytest.mark.slow
def test_a_replayed_earlier_announcement_of_the_coordinator_is_replaced(mosquitto, tmp_path):
    config = signed_config(tmp_path, mosquitto.address.port)
    dev_0 = load_signer(tmp_path / "dev-0.key")
    with serving(config, reassert_s=2.0), stand_ins(mosquitto) as fleet:
        first = fleet.announcement(0)
        assert first.auth is not None
        fleet.send([sign(stand_in_update(0, 0), dev_0, run=first.auth.run)])
        current = fleet.announcement(1).to_wire()
        # The coordinator's own round-0 announcement, signed by it, retained again: every
        # device connecting later would hear round 0, which they answered, and wait.
        seen = len(fleet.inbox.messages)
        fleet.publish(round_topic("lab"), first.to_wire(), retain=True)
        assert wait_for(fleet.inbox, current, after=seen) == [first.to_wire(), current]
        assert retained(mosquitto, "late-device") == current

        # Anything else retained there soon after (a cleared topic): put back too, once
        # the coordinator's pace (REASSERT_S) allows, by the main loop.
        seen = len(fleet.inbox.messages)
        fleet.publish(round_topic("lab"), b"", retain=True)
        assert wait_for(fleet.inbox, current, after=seen) == [b"", current]
        assert retained(mosquitto, "later-device") == current
    # Counted once each; the coordinator's own republications were not counted.
    assert rejections(config) == {"foreign_announcement": 2}


def test_the_copy_retained_before_a_restart_is_replaced_without_a_count(mosquitto, tmp_path):
    config = signed_config(tmp_path, mosquitto.address.port, ec=True)
    with serving(config), stand_ins(mosquitto) as fleet:
        before = fleet.announcement(0).to_wire()
    # The restarted coordinator signs round 0 afresh (other bytes); the broker still holds
    # the previous process's copy, which arrives first and is no intruder.
    with serving(config) as manager, stand_ins(mosquitto, "watch-2") as fleet:
        now = manager.announcement.to_wire()
        assert now != before and RoundAnnouncement.from_wire(now).round == 0
        wait_for(fleet.inbox, now)
        assert retained(mosquitto, "late-device") == now
    assert rejections(config) == {}
