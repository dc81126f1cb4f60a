"""The round owner runs the single coordinator's round cycle (coordinator/rounds/cycle.py),
so it does what the single coordinator does around a round, over the worker tier: it skips
past the rounds a rolled-back database no longer holds, says out loud that a lost one
started a new run, keeps the stalled gauge, reads the devices' statuses (over a real
Mosquitto), and its workers set aside, when they restart, the stored updates today's
checks refuse."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import pytest

from coordinator.config import load as load_config
from coordinator.keys import CoordinatorKeys
from coordinator.tier.intake import Intake
from coordinator.tier.partial_wire import CollectRequest
from coordinator.tier.worker_store import WorkerStore
from fleet.transports.broker import MosquittoBroker
from protocol import AgentState, RoundAnnouncement, Status, status_topic
from tests.mqtt_helpers import connected
from tests.test_owner import WORKERS, Tier, owner_service, sharded_toml, signed
from tests.test_worker_intake import make_keys


def _status(client: str, run: str, last_round: int) -> bytes:
    return Status(fleet="lab", client=client, state=AgentState.ONLINE, version="t",
                  last_round=last_round, run=run).to_wire()  # fmt: skip


def test_the_owner_skips_past_the_rounds_a_rolled_back_database_no_longer_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(tmp_path, 3)
    tier = Tier(tmp_path, keys, clients=3, rounds=0)
    owner = tier.owner
    before = owner.announcement
    assert owner.round == 0
    for i in range(3):  # the devices answered up to round 7 of this run
        assert owner.record_status(_status(f"dev-{i}", owner.run_id, 7)) is not None
    with caplog.at_level(logging.WARNING):
        (skipped,) = owner.poll()
    assert isinstance(skipped, RoundAnnouncement) and skipped.round == 8 == owner.round
    assert "devices have answered up to round 7" in caplog.text
    assert skipped.global_classes == before.global_classes
    # The workers follow it, and the devices' updates of round 8 close it.
    for intake in tier.intakes.values():
        assert intake.hear(skipped.to_wire()) is None
    for name, update in zip(WORKERS, signed(keys, owner.run_id, 3, round_=8), strict=True):
        tier.offer(name, update)
    (ask_all,) = owner.poll()
    tier.answer([ask_all])
    (closed,) = owner.poll()
    assert isinstance(closed, RoundAnnouncement) and closed.round == 9
    tier.stop_owner()


def test_an_owner_whose_database_was_lost_says_so_out_loud(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(tmp_path, 3)
    tier = Tier(tmp_path, keys, clients=3)
    first = tier.owner.run_id
    tier.stop_owner()
    database = tier.cfg.database
    for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm")):
        path.unlink(missing_ok=True)  # the runs file beside it remains
    with caplog.at_level(logging.WARNING):
        tier.owner = tier.start_owner()
    assert f"no database at {database}" in caplog.text
    assert f"the state of run {first} is lost" in caplog.text
    assert tier.owner.run_id != first
    tier.stop_owner()


def test_a_worker_restarted_sets_aside_the_stored_updates_todays_checks_refuse(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(tmp_path, 3)
    tier = Tier(tmp_path, keys, clients=3)
    owner = tier.owner
    updates = signed(keys, owner.run_id, 3)
    for update in updates:
        tier.offer("w1", update)
    tier.intakes["w1"].store.close()
    # Restarted under a stricter configuration: the stand-in updates' counts exceed it.
    stricter = dataclasses.replace(tier.cfg.admission_checks(), max_count=1)
    with caplog.at_level(logging.WARNING):
        restarted = Intake(
            name="w1", admission=stricter, keys=CoordinatorKeys.load(tier.cfg.security),
            store=WorkerStore(tmp_path / "worker-w1.sqlite3"), clock=tier.clock,
        )  # fmt: skip
    assert restarted.rejected == {"quarantined": 3}
    assert "fails today's checks (count_above_max); quarantined" in caplog.text
    partial = restarted.collect(run=owner.run_id, round_=0)
    assert partial.partial.clients == frozenset()  # nothing refused is summed
    restarted.store.close()
    tier.stop_owner()


def test_the_owner_reads_the_devices_statuses_over_mosquitto(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path, 2)
    cfg = load_config(sharded_toml(tmp_path, mosquitto.address.port, keys, clients=2))
    heard = threading.Event()
    with owner_service(cfg) as owner:
        record = owner.reports.record

        def recorded(status: Status) -> None:
            record(status)
            heard.set()

        owner.reports.record = recorded  # type: ignore[method-assign]
        with connected(mosquitto.address, "dev-0") as (client, _):
            payload = _status("dev-0", owner.run_id, 0)
            client.publish(status_topic("lab", "dev-0"), payload, qos=1, retain=True)
            assert heard.wait(10)
        assert owner.store.summary()["clients_online"] == 1


def test_a_round_below_the_floor_after_its_extensions_is_stalled_and_waits_for_a_receipt(
    tmp_path: Path,
) -> None:
    # As the single coordinator does (coordinator/rounds/cycle.py): extended again, with the
    # stalled gauge up, until a device answers.
    keys = make_keys(tmp_path, 3)
    tier = Tier(tmp_path, keys, clients=3, timeout_s=60.0)
    owner = tier.owner
    for _ in range(tier.cfg.rounds.max_extensions):
        tier.clock.now += 60.0
        assert owner.metrics.value("protofleet_round_stalled") == 0
        assert len(owner.poll()) == 1  # extended, announced again
    assert owner.metrics.value("protofleet_round_stalled") == 1
    tier.clock.now += 60.0
    (again,) = owner.poll()  # past its extensions, below the floor of 1: stalled
    assert isinstance(again, RoundAnnouncement) and again.round == 0
    assert owner.metrics.value("protofleet_round_stalled") == 1
    tier.offer("w1", signed(keys, owner.run_id, 1)[0])
    tier.clock.now += 60.0
    (ask_all,) = owner.poll()
    assert isinstance(ask_all, CollectRequest)
    tier.stop_owner()
