"""Faults one after another and overlapping, under load (issue 53): a round owner with
two workers behind a real Mosquitto (persistent, as shipped), and ``DEVICES`` stand-in
devices (fleet/powercut/coordinator_cuts.py::StandInDevices: one MQTT client per group of
devices, each device answering every round it holds no receipt for). Not real agents:
this machine's two cores, shared, cannot run hundreds of agent processes.

The groups: a quarter of the devices behind a proxy adding ``LATENCY_S`` to every chunk
each way (bench/fault_proxy.py), a tenth behind a proxy that partitions them from the
broker for ``PARTITION_S``, the rest direct. The faults, at the seconds of ``SCHEDULE``:
the broker restarted 3 times, the round owner killed with SIGKILL 3 times (and started
again, as systemd would), a worker killed with SIGKILL (and started again), the
partition. Then the run goes on until a round closes after the last fault.

- ``reliability.fault_matrix_lost``: receipted updates no worker's database holds (run,
  round, client and digest as the receipt names them);
- ``reliability.fault_matrix_double_counted``: per closed round, clients the workers'
  final partials counted beyond the distinct clients their databases hold for it;
- ``reliability.fault_matrix_worst_round_over_deadline_s``: the longest round's open time
  less ``TIMEOUT_S`` (negative: every round closed within its first deadline);
- ``reliability.fault_matrix_recovery_<fault>_s``: seconds from each fault to the first
  round closed after it, and ``..._rounds_closed``, ``..._receipted``, ``..._devices``.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.fault_proxy import FaultProxy
from fleet.powercut.coordinator_cuts import StandInDevices, write_config
from fleet.transports.broker import MosquittoBroker

DEVICES = 300
QUORUM = 0.6
TIMEOUT_S = 30.0
LATENCY_S = 0.1
PARTITION_S = 60.0
WORKERS = ("w1", "w2")
TIER = (
    "[robust]\nmedian_count_cap = false\nmedian_norm_clip = false\n"
    'median_direction_screen = false\n[workers]\nnames = ["w1", "w2"]\n'
    'local_sets = "omit"\ncollect_retry_s = 1.0\n'
)
#: (seconds after the start, fault): one after another, the partition overlapping two.
SCHEDULE = (
    (15.0, "broker_restart_1"),
    (30.0, "owner_kill_1"),
    (45.0, "worker_kill"),
    (60.0, "partition"),
    (75.0, "broker_restart_2"),
    (90.0, "owner_kill_2"),
    (105.0, "broker_restart_3"),
    (115.0, "owner_kill_3"),
)
BIN = Path(sys.executable).parent


class Tier:
    """The owner and the workers as processes, each restartable."""

    def __init__(self, config: Path, logs: Path) -> None:
        self.config, self.logs = config, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in WORKERS:
            self.start(name)
        self.start("owner")

    def start(self, name: str) -> None:
        argv = ["run"] if name == "owner" else ["worker", "--name", name]
        self.procs[name] = subprocess.Popen(
            [str(BIN / "edge-coordinator"), *argv[:1], "--config", str(self.config), *argv[1:]],
            stdout=subprocess.DEVNULL, stderr=(self.logs / f"{name}.log").open("ab"),
        )  # fmt: skip

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.start(name)  # systemd's Restart=always, at once

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.wait(timeout=60)


def _closed_rounds(db: Path) -> list[tuple[int, float, float]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT round, opened_at, closed_at FROM rounds WHERE closed_at IS NOT NULL"
        ).fetchall()
    return [(int(r), float(o), float(c)) for r, o, c in rows]


def _worker_rows(state: Path) -> dict[tuple[str, int, str], set[str]]:
    """(run, round, client) -> the digests the workers' databases hold."""
    rows: dict[tuple[str, int, str], set[str]] = {}
    for db in state.glob("worker-*.sqlite3"):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            for run, round_, client, digest in conn.execute(
                "SELECT run, round, client, digest FROM updates"
            ):
                rows.setdefault((run, int(round_), client), set()).add(digest)
    return rows


def _double_counted(db: Path, rows: dict[tuple[str, int, str], set[str]]) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        counted = conn.execute(
            "SELECT round, SUM(counted) FROM worker_partials GROUP BY round"
        ).fetchall()
    distinct: dict[int, int] = {}
    for _, round_, _ in rows:
        distinct[round_] = distinct.get(round_, 0) + 1
    return sum(max(0, int(total) - distinct.get(int(r), 0)) for r, total in counted)


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "mosquitto").mkdir()
        broker = MosquittoBroker(
            extra_config=f"persistence true\npersistence_location {root / 'mosquitto'}/\n"
            "autosave_interval 1\n"
        ).start()
        slow = FaultProxy((broker.address.host, broker.address.port), delay_s=LATENCY_S)
        cut = FaultProxy((broker.address.host, broker.address.port))
        state = root / "state"
        config = root / "tier.toml"
        write_config(config, state=state, port=broker.address.port,
                     quorum=int(QUORUM * DEVICES), timeout_s=TIMEOUT_S, extra=TIER)  # fmt: skip
        tier = Tier(config, root)
        n_slow, n_cut = DEVICES // 4, DEVICES // 10
        n_direct = DEVICES - n_slow - n_cut
        groups: list[StandInDevices] = []
        faults: dict[str, float] = {}
        try:
            groups = [
                StandInDevices(broker.address.port, devices=n_direct, client_id="direct"),
                StandInDevices(slow.port, devices=n_slow, first=n_direct, client_id="slow"),
                StandInDevices(cut.port, devices=n_cut, first=n_direct + n_slow, client_id="cut"),
            ]
            start = time.time()
            heal_at = dict((f, at) for at, f in SCHEDULE)["partition"] + PARTITION_S
            healed = False
            for at, fault in SCHEDULE:
                # The schedule itself: faults at fixed seconds from the start.
                time.sleep(max(0.0, start + at - time.time()))
                if not healed and at >= heal_at:
                    cut.heal()
                    healed = True
                faults[fault] = time.time()
                print(f"  {at:5.0f} s: {fault}", file=sys.stderr)
                if fault.startswith("broker_restart"):
                    broker.stop()
                    broker.start()
                elif fault.startswith("owner_kill"):
                    tier.kill("owner")
                elif fault == "worker_kill":
                    tier.kill("w1")
                elif fault == "partition":
                    cut.partition()
            time.sleep(max(0.0, start + heal_at - time.time()))
            cut.heal()
            faults["partition_healed"] = time.time()
            last = max(faults.values())
            deadline = time.time() + 300
            db = state / "coordinator.sqlite3"
            while not any(c > last for _, _, c in _closed_rounds(db)):
                if time.time() > deadline:
                    raise TimeoutError("no round closed after the last fault")
                time.sleep(0.5)  # poll interval: another process's database
        finally:
            for group in groups:
                group.close()
            tier.stop()
            slow.close()
            cut.close()
            broker.stop()
        receipts = {k: d for g in groups for k, d in g.receipts.items()}
        rows = _worker_rows(state)
        lost = sum(d not in rows.get(k, set()) for k, d in receipts.items())
        closed = _closed_rounds(db)
        results = {
            "reliability.fault_matrix_devices": float(DEVICES),
            "reliability.fault_matrix_receipted": float(len(receipts)),
            "reliability.fault_matrix_lost": float(lost),
            "reliability.fault_matrix_double_counted": float(_double_counted(db, rows)),
            "reliability.fault_matrix_rounds_closed": float(len(closed)),
            "reliability.fault_matrix_worst_round_over_deadline_s": max(c - o for _, o, c in closed)
            - TIMEOUT_S,
        }
        for fault, at in faults.items():
            after = [c for _, _, c in closed if c > at]
            results[f"reliability.fault_matrix_recovery_{fault}_s"] = (
                min(after) - at if after else float("nan")
            )
        return results


if __name__ == "__main__":
    for key, value in sorted(run().items()):
        print(f"{key}  {value:.4g}")
