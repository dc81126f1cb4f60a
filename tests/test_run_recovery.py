"""Runs bind announcements and receipts to one life of the coordinator's database, and its
loss is loud and never stalls the fleet (docs/protocol.md, "Runs"; docs/deploy.md, "A lost
or rolled-back database"):

- a lost database starts a new run that the devices adopt, since it started later;
- a rolled-back one opens the round after the highest the devices answered;
- a device never answers a round of a run older than the one it follows, and a fresh one
  that first heard an old retained announcement still follows the new run.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.open_round import OpenRound
from coordinator.rounds.run_reports import RunReports
from coordinator.storage.store import Store
from edge_agent.agent import Agent
from export import bundle as bundle_mod
from protocol import AgentState, RoundAnnouncement, Status
from tests.agent_helpers import agent_config, announcement
from tests.coordinator_helpers import config, stand_in_update
from tests.process_helpers import agent_process, coordinator_process
from tests.process_helpers import status as shown
from tests.test_agent_service import write_config
from tests.test_deploy import coordinator_toml


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def manager(state: Path, clock: Clock, **rounds: Any) -> RoundManager:
    cfg = config(state, allow_list=tuple(f"dev-{i}" for i in range(5)), **rounds)
    return RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=clock)


def status(client: str, run: str, last_round: int | None) -> bytes:
    return Status(fleet="lab", client=client, state=AgentState.ONLINE, version="t",
                  last_round=last_round, run=run).to_wire()  # fmt: skip


def snapshot(database: Path, to: Path) -> int:
    """A consistent copy of ``database`` (SQLite's backup, safe beside a live writer);
    the latest round it holds."""
    live, copy = sqlite3.connect(database), sqlite3.connect(to)
    try:
        live.backup(copy)
        return int(copy.execute("SELECT max(round) FROM rounds").fetchone()[0])
    finally:
        live.close()
        copy.close()


def play(m: RoundManager, clock: Clock, rounds: int, clients: int = 2) -> None:
    for _ in range(rounds):
        for i in range(clients):
            assert m.offer(stand_in_update(i, m.round).to_wire()).accepted
        clock.now += 1.0
        assert m.poll() is not None


# -- the coordinator ---------------------------------------------------------------------


def test_a_rolled_back_database_opens_the_round_after_the_devices_last(tmp_path, caplog):
    clock = Clock()
    m = manager(tmp_path / "s", clock, min_clients=2, wait_after_quorum_s=0.0, timeout_s=60.0)
    play(m, clock, 2)
    backup = tmp_path / "backup.sqlite3"
    assert snapshot(m.store.path, backup) == 2  # the database as it stood at round 2
    play(m, clock, 10)  # the devices go on to answer round 11
    m.store.close()
    shutil.copy(backup, m.store.path)
    for suffix in ("-wal", "-shm"):
        Path(f"{m.store.path}{suffix}").unlink(missing_ok=True)

    back = manager(tmp_path / "s", clock, min_clients=2, wait_after_quorum_s=0.0, timeout_s=60.0)
    assert back.round == 2 and back.run_id == m.run_id
    before = back.announcement
    for i in range(2):
        back.record_status(status(f"dev-{i}", back.run_id, 11))
    with caplog.at_level(logging.WARNING):
        skipped = back.poll()
    assert skipped is not None and skipped.round == 12 == back.round
    assert "devices have answered up to round 11" in caplog.text
    # The last global state it holds, signed afresh for the new round.
    assert skipped.global_classes == before.global_classes
    assert (skipped.global_prototypes == before.global_prototypes).all()
    # The devices answer it, and it closes.
    play(back, clock, 1)
    assert back.round == 13
    # A device that reports a round behind the open one moves nothing.
    back.record_status(status("dev-0", back.run_id, 12))
    assert back.poll() is None and back.round == 13


def test_one_device_lying_about_its_round_does_not_move_the_fleet(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=3, wait_after_quorum_s=0.0, timeout_s=60.0)
    play(m, clock, 3, clients=3)
    for i, r in enumerate((2, 2, 2_000_000)):  # honest devices answered round 2
        m.record_status(status(f"dev-{i}", m.run_id, r))
    assert m.poll() is None and m.round == 3


def test_the_open_round_lost_with_its_updates_is_skipped_once_its_deadline_passed(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=2, wait_after_quorum_s=0.0, timeout_s=60.0)
    play(m, clock, 1)
    for i in range(2):  # they answered round 1, which this database holds no update of
        m.record_status(status(f"dev-{i}", m.run_id, 1))
    assert m.poll() is None  # in flight, perhaps: not before the deadline
    clock.now += 60.0
    skipped = m.poll()
    assert skipped is not None and skipped.round == 2
    # With an update stored the deadline extends as before, nothing is dropped.
    m.offer(stand_in_update(0, 2).to_wire())
    m.record_status(status("dev-1", m.run_id, 2))
    clock.now += 60.0
    assert m.poll().round == 2  # type: ignore[union-attr]


def test_a_lost_database_starts_a_later_run_and_says_so(tmp_path, caplog):
    clock = Clock()
    first = manager(tmp_path / "s", clock, min_clients=1, wait_after_quorum_s=0.0)
    play(first, clock, 3, clients=1)
    first.store.close()
    _remove(first.store.path)  # the runs file beside it remains
    clock.now += 5.0
    with caplog.at_level(logging.WARNING):
        again = manager(tmp_path / "s", clock, min_clients=1, wait_after_quorum_s=0.0)
    assert f"no database at {again.store.path}" in caplog.text
    assert again.round == 0 and again.run_id != first.run_id
    assert again.announcement.run == again.run_id
    assert again.announcement.run_started > first.announcement.run_started
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again.record_status(status("dev-0", first.run_id, 3))
    assert f"client dev-0 follows run {first.run_id}" in caplog.text


def _warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the round manager warned of (the insecure fleet's own warning aside)."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("coordinator.rounds") and r.levelno >= logging.WARNING]  # fmt: skip


def test_a_first_start_is_said_quietly_and_a_lost_folder_by_the_devices(tmp_path, caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO):
        first = manager(tmp_path / "s", clock, min_clients=1)
    assert "started run" in caplog.text and not _warned(caplog)
    first.store.close()
    shutil.rmtree(tmp_path / "s")  # the whole folder, runs file and all
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = manager(tmp_path / "s", clock, min_clients=1)
        assert not _warned(caplog)  # nothing on disk says a run came before
        again.record_status(status("dev-0", first.run_id, 7))  # the devices do
    assert f"client dev-0 follows run {first.run_id}" in caplog.text


def test_a_zero_byte_database_is_a_new_run_said_out_loud(tmp_path, caplog):
    (tmp_path / "coordinator.sqlite3").write_bytes(b"")
    cfg = config(tmp_path)
    assert cfg.database == tmp_path / "coordinator.sqlite3"
    with caplog.at_level(logging.WARNING):
        RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=Clock())
    assert "no database at" in caplog.text and "started run" in caplog.text


def test_run_reports_trust_the_second_highest_from_three_devices():
    reports = RunReports(run="r", path=Path("x"))
    open_ = OpenRound(number=5, opened_at=0.0, deadline=10.0)
    reports.record(Status.from_wire(status("a", "r", 9)))
    assert reports.answered_past(open_, deadline_passed=False) == 9  # one device: its word
    reports.record(Status.from_wire(status("b", "r", 7)))
    reports.record(Status.from_wire(status("c", "r", 7)))
    assert reports.answered_past(open_, deadline_passed=False) == 7
    reports.record(Status.from_wire(status("b", "other", 99)))  # b left for another run
    assert reports.elsewhere == {"b": "other"}
    assert reports.answered_past(open_, deadline_passed=False) == 9


# -- the device --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_device_follows_later_runs_and_refuses_older_ones(small_zoo, tmp_path):
    agent = Agent(agent_config(tmp_path / "a", small_zoo, agent_id="dev-a", domain="clean"))

    def of_run(round_: int, run: str, started: float) -> RoundAnnouncement:
        return dataclasses.replace(
            announcement(agent.bundle_id, round_), run=run, run_started=started
        )

    # A fresh device hears the retained announcement of an earlier run, round 94.
    assert agent.handle(of_run(94, "old0000000000000", 100.0)).reason == "answered"
    # The new run (started later) is at round 1: the device adopts it and answers.
    assert agent.handle(of_run(1, "new0000000000000", 200.0)).reason == "answered"
    assert agent.run == "new0000000000000" and agent.last_round == 1
    # The old run's announcement again: refused, and said in the status.
    old = agent.handle(of_run(95, "old0000000000000", 100.0))
    assert old.reason == "old_run" and "began before run new0000000000000" in old.mismatch
    assert agent.handle(of_run(2, "new0000000000000", 200.0)).reason == "answered"
    # Across a restart it still follows the new run.
    again = Agent(agent.cfg)
    assert again.run == "new0000000000000" and again.last_round == 2
    assert again.handle(of_run(2, "new0000000000000", 200.0)).reason in {
        "already_answered",
        "republish",
    }
    assert again.ignored.counts == {"old_run": 1}


# -- over a real Mosquitto, with the real services -----------------------------------------


def _fleet(tmp_path: Path, small_zoo: Path, port: int) -> tuple[Path, Path]:
    bundle_id = bundle_mod.load(small_zoo).id
    coordinator = coordinator_toml(
        tmp_path / "coordinator.toml", port=port, bundle=bundle_id, timeout_s=120.0
    )
    agent, _ = write_config(tmp_path / "a", small_zoo, "dev-a", "clean", port, epochs=1)
    return coordinator, agent


def _database(coordinator: Path) -> Path:
    return coordinator.parent / "coord" / "coordinator.sqlite3"


def _remove(database: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.broker
def test_a_rolled_back_then_deleted_database_resumes_the_fleet(mosquitto, small_zoo, tmp_path):
    """One fleet, two losses (one agent's start-up and training serve both): the database
    replaced by a copy taken rounds before the device's last answer, then deleted."""
    coordinator, agent = _fleet(tmp_path, small_zoo, mosquitto.address.port)
    database, backup = _database(coordinator), tmp_path / "backup.sqlite3"
    served = coordinator_process(coordinator)
    device = agent_process(agent)
    try:
        # Rolled back: the same run, behind the device. It skips past the device's round.
        device.wait_for("round 1: update stored by the coordinator", timeout=120)
        kept = snapshot(database, backup)
        seen = device.wait_for(f"round {kept + 2}: update stored by the coordinator", timeout=120)
        assert served.stop() == 0
        _remove(database)
        shutil.copy(backup, database)
        served = coordinator_process(coordinator)
        line = served.wait_for("devices have answered up to round", timeout=60)
        said = next(x for x in served.lines if "devices have answered up to round" in x)
        skipped_to = int(said.split("opened round ", 1)[1].split()[0])
        assert skipped_to > kept + 2
        served.wait_for(f"round {skipped_to} closed with 1 update(s) from dev-a", after=line)
        seen = device.wait_for(f"round {skipped_to}: update stored by the coordinator", after=seen)
        before = shown("edge-coordinator", coordinator)["run"]

        # Deleted: a new run, said out loud, which the device adopts; its round 0 closes.
        assert served.stop() == 0
        _remove(database)
        served = coordinator_process(coordinator)
        served.wait_for("no database at")
        device.wait_for("the coordinator began a new run", after=seen, timeout=60)
        served.wait_for("round 0 closed with 1 update(s) from dev-a", timeout=60)
        after = shown("edge-coordinator", coordinator)["run"]
        assert after["id"] != before["id"] and after["started"] > before["started"]
        assert shown("edge-agent", agent)["run"] == after["id"]
        assert device.stop() == 0
    finally:
        device.close()
        served.close()
