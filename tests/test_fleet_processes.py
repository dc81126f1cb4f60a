"""The processes of a fleet over MQTT: started, watched, stopped. A broker it cannot use,
a process that dies, Ctrl-C, SIGTERM or SIGKILL: it says what happened and leaves nothing
running."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fleet.data import partition as part
from fleet.transports.broker import MosquittoBroker, free_port
from fleet.transports.mqtt import (
    AGENTS_PER_WORKER,
    _liveness,
    _StopRequest,
    parse_broker_url,
    workers_for,
)
from fleet.transports.runner import run
from fleet.transports.spec import FLEET, RunSpec
from fleet.transports.watcher import Watcher
from protocol import RoundAnnouncement, round_topic
from runtime.cliutil import CommandFailed, Terminated, UsageError
from tests.mqtt_helpers import connected
from tests.process_helpers import LoggedProcess, group_members


def test_a_broker_url_is_host_and_port() -> None:
    assert parse_broker_url("mqtt://10.0.0.5:1884") == ("10.0.0.5", 1884)
    assert parse_broker_url("broker.lan") == ("broker.lan", 1883)
    with pytest.raises(UsageError):
        parse_broker_url("http://x")


def _long_fleet(bundle: Path, tmp_path: Path, *extra: str) -> LoggedProcess:
    """A 2-agent MQTT fleet of 500 rounds, leading a process group of its own."""
    argv = ["--log-level", "INFO", "run", "--transport", "mqtt", "--clients", "2",
            "--rounds", "500", "--train", "20", "--test", "10", "--out-dim", "16",
            "--bundle", str(bundle), "--out", str(tmp_path / "out"), "--no-progress",
            *extra]  # fmt: skip
    return LoggedProcess("edge-fleet", argv, new_session=True)


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_fleet_process_takes_its_children_with_it(small_zoo: Path, tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, kill -9) runs no clean-up: the broker, the coordinator and
    the workers notice their parent's death themselves and exit."""
    fleet = _long_fleet(small_zoo, tmp_path)
    group = fleet.proc.pid
    try:
        fleet.wait_for("round 2 of 500 closed", timeout=120)
        children = {p: c for p, c in group_members(group).items() if p != fleet.proc.pid}
        kinds = " ".join(children.values())
        assert (
            "mosquitto" in kinds
            and "edge-coordinator" in kinds
            and "fleet.transports.worker" in kinds
        )
        # A pidfd becomes readable when its process ends: an event to wait on, not a poll.
        fds = {pid: os.pidfd_open(pid) for pid in children}
        fleet.kill()
        deadline = time.monotonic() + 60
        for pid, fd in fds.items():
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            os.close(fd)
            assert ready, f"{children[pid]} outlived the fleet process"
    finally:
        fleet.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # whatever a failure left running


@pytest.mark.broker
@pytest.mark.parametrize(
    ("how", "status"),
    [("ctrl-c", 128 + signal.SIGINT), ("sigterm", 128 + signal.SIGTERM)],
)
@pytest.mark.slow
def test_a_stopped_fleet_leaves_no_process_behind(
    small_zoo: Path, tmp_path: Path, how: str, status: int
) -> None:
    """Ctrl-C reaches the terminal's whole foreground group (edge-fleet, Mosquitto, the
    coordinator, the workers); `kill` or `timeout` sends SIGTERM to edge-fleet alone.
    Either way the run stops everything it started before it exits."""
    fleet = _long_fleet(small_zoo, tmp_path)
    try:
        fleet.wait_for("round 2 of 500 closed", timeout=120)
        group = os.getpgid(fleet.proc.pid)
        if how == "ctrl-c":
            os.killpg(group, signal.SIGINT)
        else:
            fleet.signal(signal.SIGTERM)
        assert fleet.proc.wait(timeout=90) == status
        fleet.wait_for("interrupted" if how == "ctrl-c" else "terminated", timeout=10)
        # edge-fleet waits for each process it started, so none may be left in its group.
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    finally:
        fleet.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(fleet.proc.pid, signal.SIGKILL)  # whatever a failure left running


@pytest.mark.broker
@pytest.mark.parametrize(
    ("victim", "name", "log_file", "extra"),
    [
        ("edge-coordinator", "the coordinator", "coordinator.log", ()),
        ("worker-1.json", "worker 1", "worker-1.log", ()),
        # Sharded: without the liveness check the owner would wait for the dead worker's
        # partial, and the fleet for the owner.
        (
            "edge-coordinator worker --name w2 ",
            "coordinator worker w2",
            "coordinator-w2.log",
            ("--coordinator-workers", "2", "--method", "fedproto", "--workers", "1"),
        ),
    ],
)
@pytest.mark.slow
def test_a_fleet_whose_process_dies_names_it_and_stops_the_rest(
    small_zoo: Path, tmp_path: Path, victim: str, name: str, log_file: str, extra: tuple[str, ...]
) -> None:
    """The OOM killer takes the coordinator, a worker of agents or a coordinator worker
    mid-run: edge-fleet says which and where its log is, exits 1 (a failure, not a usage
    error: 2), and stops the rest. Before, a dead coordinator left the fleet waiting out
    its 30-minute no-progress limit."""
    fleet = _long_fleet(small_zoo, tmp_path, *extra)
    group = fleet.proc.pid
    try:
        fleet.wait_for("round 2 of 500 closed", timeout=120)
        (pid,) = [p for p, command in group_members(group).items() if victim in command]
        os.kill(pid, signal.SIGKILL)
        assert fleet.proc.wait(timeout=90) == 1
        fleet.wait_for(f"{name} exited early", timeout=10)
        (line,) = [x for x in fleet.lines if "exited early" in x]
        assert line.startswith(f"edge-fleet: error: {name} exited early (status -9); see ")
        assert line.rstrip().endswith(f"/logs/{log_file}")
        assert not any("Traceback" in x for x in fleet.lines)
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    finally:
        fleet.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # whatever a failure left running


def test_a_stop_request_is_raised_at_the_runs_next_check_as_the_signal_it_was() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup
    try:
        assert set(_StopRequest().actions()) == {signal.SIGTERM}  # ignored stays ignored
        # As in a terminal, whatever this pytest inherited (a job started in the
        # background of a script inherits SIGINT ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop = _StopRequest()
        stop.check()  # nothing asked: no exception
        actions = stop.actions()
        assert set(actions) == {signal.SIGINT, signal.SIGTERM}
        actions[signal.SIGTERM](signal.SIGTERM)
        actions[signal.SIGINT](signal.SIGINT)  # the first request decides
        with pytest.raises(Terminated):
            stop.check()
        interrupted = _StopRequest()
        interrupted.actions()[signal.SIGINT](signal.SIGINT)
        with pytest.raises(KeyboardInterrupt) as caught:
            interrupted.check()
        assert caught.type is KeyboardInterrupt  # not its subclass Terminated
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.broker
def test_a_broker_the_fleet_cannot_use_is_named_before_anything_starts(
    small_zoo: Path, tmp_path: Path
) -> None:
    # Before, agents and coordinator were started anyway and the fleet sat silent until
    # its 30-minute no-progress limit.
    partition = part.digits5(clients=2, split="label", seed=1, train=30, test=20)
    nobody, port = free_port("127.0.0.1"), free_port("127.0.0.1")
    # No anonymous access: this broker answers, and refuses.
    locked = f"listener {port} 127.0.0.1\nallow_anonymous false\n"
    with MosquittoBroker(port=port, listener_config=locked):
        cases = [
            (nobody, f"cannot reach the MQTT broker at 127.0.0.1:{nobody}: Connection refused"),
            (port, f"the MQTT broker at 127.0.0.1:{port} refused the connection: Not authorized"),
        ]
        for n, (at, message) in enumerate(cases):
            out = tmp_path / str(n)
            spec = RunSpec(method="fedpcl", rounds=1, bundle=small_zoo, out=out, workers=1,
                           broker=f"mqtt://127.0.0.1:{at}", out_dim=32, progress=False)  # fmt: skip
            with pytest.raises(CommandFailed) as failed:
                run(spec, partition)
            assert str(failed.value) == message
            assert not list(spec.layout.logs.glob("*.log"))  # no coordinator, no worker


def test_a_coordinator_that_finished_is_not_taken_for_a_crash(tmp_path: Path) -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    crashed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    done.wait()
    crashed.wait()
    log = tmp_path / "x.log"
    finished = _liveness({"the coordinator": (done, log)}, lambda: None, lambda: None, grace_s=0)
    finished()  # its final announcement may still be on its way: nothing to report
    failed = _liveness({"the coordinator": (crashed, log)}, lambda: None, lambda: None, grace_s=0)
    with pytest.raises(CommandFailed, match=r"the coordinator exited early \(status 3\)"):
        failed()
    worker = _liveness({"worker 0": (done, log)}, lambda: None, lambda: None, grace_s=0)
    with pytest.raises(CommandFailed, match="worker 0 exited early"):
        worker()  # a worker never finishes by itself


@pytest.mark.broker
def test_the_fleet_watcher_follows_announcements_over_the_default_size_cap(mosquitto) -> None:
    # FedPCL's announcement to 200 agents carries 200 padded local sets: 2 MB. Ignored as
    # too large, it left `edge-fleet run --clients 200` waiting until the coordinator's exit.
    rows = np.zeros((10, 256), np.float32)
    big = RoundAnnouncement(
        fleet=FLEET, round=2, run="r1", run_started=0.0, bundle="b" * 64, method="fedpcl",
        classes=tuple(str(c) for c in range(10)), dim=256, deadline=0.0,
        global_classes=tuple(range(10)), global_prototypes=rows,
        local_sets={f"client-{i:04d}": rows for i in range(200)},
    )  # fmt: skip
    payload = big.to_wire()
    assert len(payload) > 1 << 20
    watcher = Watcher(mosquitto.address.host, mosquitto.address.port, expected=0)
    try:
        with connected(mosquitto.address, "coordinator") as (pub, _):
            pub.publish(round_topic(FLEET), payload, qos=1, retain=True).wait_for_publish(30)
        with watcher._cond:
            assert watcher._cond.wait_for(lambda: watcher.round == 2, timeout=30)
    finally:
        watcher.close()


def test_no_worker_hosts_more_agents_than_pahos_select_can_watch() -> None:
    assert workers_for(1000, 4) == 4  # 250 each
    assert workers_for(3, 4) == 3  # never an idle worker
    assert workers_for(1000, 2) == -(-1000 // AGENTS_PER_WORKER)
    assert 3 * AGENTS_PER_WORKER < 1024  # three sockets an agent, under select()'s limit
