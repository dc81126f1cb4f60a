"""``edge-fleet run --coordinator-workers N``: the simulated fleet's coordinator sharded as a
deployment shards it (docs/scale.md), the round owner over N ``edge-coordinator worker``
processes on an MQTT 5 shared subscription; refused, in one line and before anything
starts, where the round owner or the broker cannot serve it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from coordinator.closed_form_settings import ClosedFormSettings
from coordinator.config import (
    CoordinatorConfig,
    ModelSettings,
    WorkersSettings,
    database_in,
)
from coordinator.config import load as load_coordinator_config
from coordinator.strategies import RobustOptions
from coordinator.strategies.base import RAW
from coordinator.tier.owner import refusal
from edge_agent.methods import METHODS
from fleet.cli.commands import cmd_compare, cmd_run
from fleet.cli.main import build_parser
from fleet.cli.options import sweep_options
from fleet.transports import mqtt as mqtt_transport
from fleet.transports.configs import coordinator_tables, write_config
from fleet.transports.layout import RunLayout
from fleet.transports.mqtt import coordinator_worker_log, run_mqtt
from fleet.transports.spec import FLEET, RunSpec
from protocol import RoundAnnouncement
from protocol.methods import wire_method
from runtime.cliutil import UsageError
from runtime.security import CoordinatorSecurity
from tests.process_helpers import LoggedProcess


def _args(tmp_path: Path, *argv: str) -> list[str]:
    return ["run", "--bundle", str(tmp_path / "bundle"), "--out", str(tmp_path / "out"), *argv]


def _owner_line(method: str) -> str | None:
    """What the round owner itself says of ``method`` over two workers, every other setting
    as it needs them (None: it runs the method)."""
    config = CoordinatorConfig(
        fleet=FLEET, state_dir=Path("unused"), model=ModelSettings(method=method, feature_dim=8),
        workers=WorkersSettings(count=2, local_sets="omit"),
        robust=RobustOptions() if wire_method(method).closed_form else RAW,
        security=CoordinatorSecurity(insecure=True),
        closed_form=ClosedFormSettings(count_cap=0),  # the tier caps no client's statistics
    )  # fmt: skip
    return refusal(config)


#: The methods the round owner refuses as it is built now (fedavg, fpl, feddbp, solo).
REFUSED = [m for m in METHODS if _owner_line(m) is not None]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--transport", "memory"], "applies to --transport mqtt; the memory transport"),
        (["--transport", "vector", "--method", "fedproto"], "mqtt; the vector transport"),
        (["--coordinator-workers", "0"], "must be in 1..256, got 0"),
        (["--coordinator-workers", "257"], "must be in 1..256, got 257"),
    ],
)
def test_coordinator_workers_apply_to_the_mqtt_transport_alone(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    given = argv if "--coordinator-workers" in argv else [*argv, "--coordinator-workers", "2"]
    args = build_parser().parse_args(_args(tmp_path, *given))
    with pytest.raises(UsageError) as refused:
        sweep_options(args, method=args.method)
    line = str(refused.value)
    assert line.startswith("--coordinator-workers ") and says in line and "\n" not in line


@pytest.mark.parametrize("method", METHODS)
def test_a_method_the_round_owner_refuses_is_refused_in_its_words(
    tmp_path: Path, method: str
) -> None:
    args = build_parser().parse_args(
        _args(tmp_path, "--method", method, "--coordinator-workers", "2")
    )
    line = _owner_line(method)
    if line is None:  # one the owner runs: its options resolve
        assert sweep_options(args, method=method).coordinator_workers == 2
        return
    with pytest.raises(UsageError) as refused:
        sweep_options(args, method=method)
    assert str(refused.value) == f"--coordinator-workers: {line}"


def test_a_refused_method_stops_the_command_before_anything_starts(tmp_path: Path) -> None:
    """Not even the report folder, nor the backbone zoo (minutes, the first time)."""
    argv = _args(tmp_path, "--method", REFUSED[0], "--coordinator-workers", "2")
    with pytest.raises(UsageError, match=r"^--coordinator-workers: \[workers\]: model.method"):
        cmd_run(build_parser().parse_args(argv))
    assert not (tmp_path / "out").exists() and not (tmp_path / "bundle").exists()


def test_a_comparison_is_refused_for_any_of_its_methods_before_the_first_runs(
    tmp_path: Path,
) -> None:
    argv = ["compare", "--methods", f"fedproto,fedpcl,{REFUSED[-1]}",
            "--coordinator-workers", "3", "--bundle", str(tmp_path / "bundle"),
            "--out", str(tmp_path / "out")]  # fmt: skip
    with pytest.raises(UsageError, match=rf"model.method = '{REFUSED[-1]}' does not run over"):
        cmd_compare(build_parser().parse_args(argv))
    assert not (tmp_path / "out").exists()


def test_without_mosquitto_a_sharded_fleet_needs_a_broker_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded amqtt broker speaks MQTT 3.1.1: no shared subscriptions."""
    monkeypatch.setattr(mqtt_transport, "find_mosquitto", lambda: None)
    args = build_parser().parse_args(_args(tmp_path, "--coordinator-workers", "2"))
    with pytest.raises(UsageError, match=r"needs MQTT 5 shared subscriptions.*install mosquitto"):
        sweep_options(args, method="fedpcl")
    given = _args(tmp_path, "--coordinator-workers", "2", "--broker", "mqtt://127.0.0.1:1883")
    assert sweep_options(build_parser().parse_args(given), method="fedpcl").coordinator_workers == 2
    # The single coordinator runs on amqtt as before.
    assert sweep_options(build_parser().parse_args(_args(tmp_path)), method="fedpcl")


def _config(spec: RunSpec) -> CoordinatorConfig:
    """The coordinator configuration ``spec``'s run writes, read back as the coordinator
    reads it."""
    tables = coordinator_tables(spec, "bundle-id", ("0", "1"), 2, dim=16, feature_dim=32,
                                security={"insecure": True})  # fmt: skip
    spec.out.mkdir(parents=True)
    return load_coordinator_config(write_config(spec.out / "coordinator.toml", tables))


@pytest.mark.parametrize("method", ["fedpcl", "fedproto"])
def test_a_sharded_fleets_coordinator_is_one_the_round_owner_runs(
    tmp_path: Path, method: str
) -> None:
    sharded = _config(RunSpec(method=method, rounds=2, bundle=tmp_path, out=tmp_path / "s",
                              coordinator_workers=3))  # fmt: skip
    assert refusal(sharded) is None
    assert sharded.workers.members == ("w1", "w2", "w3")
    # No median defence: the owner refuses them (no worker holds every update of a round).
    assert sharded.robust == RAW
    # FedPCL's local sets do not sum: its announcement carries the global prototypes only.
    assert sharded.workers.local_sets == ("omit" if method == "fedpcl" else "refuse")
    single = _config(RunSpec(method=method, rounds=2, bundle=tmp_path, out=tmp_path / "one"))
    assert not single.workers.enabled and single.robust == RobustOptions()


def test_the_transport_refuses_what_the_owner_would_before_any_process_starts(
    tmp_path: Path,
) -> None:
    """A run set up in code, past the command line's checks."""
    spec = RunSpec(method="fedavg", rounds=2, bundle=tmp_path, out=tmp_path / "run",
                   coordinator_workers=2, progress=False)  # fmt: skip
    tables = coordinator_tables(spec, "bundle-id", ("0", "1"), 2, dim=16, feature_dim=32,
                                security={"insecure": True})  # fmt: skip
    with pytest.raises(UsageError, match=r"^--coordinator-workers: \[workers\]: model.method"):
        run_mqtt(spec, {}, tables)
    assert not spec.layout.logs.exists()


def _updates(database: Path) -> set[tuple[int, str]]:
    with contextlib.closing(sqlite3.connect(database)) as db:
        return {(r, c) for r, c in db.execute("SELECT round, client FROM updates")}


@pytest.mark.slow
@pytest.mark.broker
def test_a_fleet_over_two_coordinator_workers_finishes_its_rounds_and_scores_them(
    small_zoo: Path, tmp_path: Path
) -> None:
    """FedPCL, the method that needs the most of the fleet's settings to run sharded."""
    out = tmp_path / "report"
    argv = ["--log-level", "INFO", "run", "--transport", "mqtt", "--coordinator-workers", "2",
            "--method", "fedpcl", "--clients", "2", "--rounds", "2", "--train", "30",
            "--test", "20", "--out-dim", "32", "--workers", "1",
            "--bundle", str(small_zoo), "--out", str(out), "--no-progress"]  # fmt: skip
    fleet = LoggedProcess("edge-fleet", argv, new_session=True)
    try:
        try:
            status = fleet.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            status = None
        assert status == 0, "".join(fleet.lines[-30:])
        # Every process the run started (broker, owner, workers, agents' hosts) was
        # waited for: none is left in its process group.
        with pytest.raises(ProcessLookupError):
            os.killpg(fleet.proc.pid, 0)
    finally:
        fleet.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(fleet.proc.pid, signal.SIGKILL)  # whatever a failure left running

    report = json.loads((out / "report.json").read_text())
    fedpcl = report["methods"]["fedpcl"]
    run_ = fedpcl["runs"]["0"]
    assert len(run_["accuracy"]) == 2
    for accuracy in run_["accuracy"].values():
        assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)
    # The report says how the coordinator ran.
    assert report["config"]["coordinator_workers"] == 2
    assert fedpcl["settings"]["coordinator_workers"] == 2
    assert "mqtt transport, coordinator sharded over 2 workers" in (out / "report.md").read_text()

    layout = RunLayout(Path(run_["run_dir"]))
    config = load_coordinator_config(layout.coordinator_config)
    assert config.workers.members == ("w1", "w2") and refusal(config) is None
    owner = database_in(layout.coordinator)
    with contextlib.closing(sqlite3.connect(owner)) as db:
        shares = db.execute("SELECT round, worker, counted FROM worker_partials").fetchall()
        announced = dict(db.execute("SELECT round, announcement FROM rounds"))
    # The owner closed each round from both workers' partials, every client once ...
    assert sorted((r, w) for r, w, _ in shares) == [(0, "w1"), (0, "w2"), (1, "w1"), (1, "w2")]
    assert [sum(n for r, _, n in shares if r == round_) for round_ in (0, 1)] == [2, 2]
    # ... and stored no update itself: the workers did, each its share.
    assert _updates(owner) == set()
    held = [_updates(config.state_dir / f"worker-{name}.sqlite3") for name in ("w1", "w2")]
    assert all(held) and set.union(*held) == {(r, c) for r in (0, 1) for c in run_["accuracy"]}
    # FedPCL over workers announces the global prototypes alone.
    later = RoundAnnouncement.from_wire(announced[1], max_bytes=1 << 30)
    assert later.local_sets == {} and len(later.global_classes) > 0
    for name in ("w1", "w2"):  # each worker's log beside the coordinator's
        assert f"worker {name} ready" in coordinator_worker_log(layout, name).read_text()
