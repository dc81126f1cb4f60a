"""Faults one after another and overlapping, under load (issue 53): a round owner with
two workers behind a real Mosquitto (persistent, as shipped), and ``DEVICES`` real agents
of an lda fleet (bench/fault_fleet.py: edge-fleet's agent configurations, signed, hosted
by its worker processes, one process per group below; digits-5 on the small zoo). lda
because the worker tier runs it, with ``closed_form.count_cap = 0`` as edge-fleet sets.
The coordinator's tables are edge-fleet's with the rounds of this matrix (quorum
``QUORUM`` of the devices, deadline ``TIMEOUT_S``) and the deployed default
``sqlite_synchronous = "GROUP"``.

The groups: a quarter of the devices behind a proxy adding ``LATENCY_S`` to every chunk
each way (bench/fault_proxy.py), a tenth behind a proxy that partitions them from the
broker for ``PARTITION_S``, the rest direct. The faults, at the seconds of ``SCHEDULE``
after every agent is online: the broker restarted 3 times, the round owner killed with
SIGKILL 3 times (and started again, as systemd would), a worker killed with SIGKILL (and
started again), the partition. Then the run goes on until a round closes after the last
fault.

- ``reliability.fault_matrix_lost``: updates the devices were told are stored that are
  not: a receipt the workers sent (bench/fault_fleet.py::ReceiptTap) whose run, round,
  client and digest no worker's database holds, or an agent whose own state says its
  statistics are stored, with no worker holding that update or, its round closed, the
  owner's total not counting it;
- ``reliability.fault_matrix_double_counted``: per closed round, clients the workers'
  final partials counted beyond the distinct clients their databases hold for it, plus
  devices the owner's statistics total counts beyond the clients it holds;
- ``reliability.fault_matrix_worst_round_over_deadline_s``: the longest round's open time
  less ``TIMEOUT_S`` (negative: every round closed within its first deadline);
- ``reliability.fault_matrix_recovery_<fault>_s``: seconds from each fault to the first
  round closed after it, and ``..._rounds_closed``, ``..._receipted``, ``..._devices``;
- ``reliability.fault_matrix_real_agents``: 1, the devices are real agents;
  ``..._statistics_stored``: agents whose state says their statistics are stored;
  ``..._peak_mb``: the peak summed resident memory of the broker, the tier, the agents'
  hosts and this process.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.fault_fleet import AgentFleet, Group, Key, ReceiptTap
from bench.fault_proxy import FaultProxy
from bench.reliability_bench import small_zoo
from fleet.transports.broker import MosquittoBroker
from fleet.transports.procmem import FleetMemory
from protocol.codec import unpack

DEVICES = 300
QUORUM = 0.6
TIMEOUT_S = 30.0
LATENCY_S = 0.1
PARTITION_S = 60.0
WORKERS = ("w1", "w2")  # [workers] count = 2, as edge-fleet names them


def coordinator(devices: int) -> dict[str, object]:
    """What this matrix sets over edge-fleet's coordinator tables: its rounds, the deployed
    default ``sqlite_synchronous`` (edge-fleet's simulations run NORMAL), and a collect
    asked again every second, not every 5 s."""
    return {
        "sqlite_synchronous": "GROUP",
        "rounds": {
            "min_clients": int(QUORUM * devices), "wait_after_quorum_s": 0.0,
            "timeout_s": TIMEOUT_S, "max_rounds": 100_000, "keep_rounds": 0,
        },
        "workers": {"collect_retry_s": 1.0},
    }  # fmt: skip


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

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]

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


def _worker_rows(state: Path) -> dict[Key, set[str]]:
    """(run, round, client) -> the digests the workers' databases hold."""
    rows: dict[Key, set[str]] = {}
    for db in state.glob("worker-*.sqlite3"):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            for run, round_, client, digest in conn.execute(
                "SELECT run, round, client, digest FROM updates"
            ):
                rows.setdefault((run, int(round_), client), set()).add(digest)
    return rows


def _double_counted(db: Path, rows: dict[Key, set[str]]) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        counted = conn.execute(
            "SELECT round, SUM(counted) FROM worker_partials GROUP BY round"
        ).fetchall()
    distinct: dict[int, int] = {}
    for _, round_, _ in rows:
        distinct[round_] = distinct.get(round_, 0) + 1
    return sum(max(0, int(total) - distinct.get(int(r), 0)) for r, total in counted)


def _statistics_held(db: Path, last_closed: int) -> tuple[dict[str, int], int]:
    """The owner's statistics as its last committed close left them
    (coordinator/tier/owner_statistics.py): client -> the round of the copy its total
    counts, and the devices the total says it sums."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        held = conn.execute(
            "SELECT client, MAX(round) FROM owner_statistics_holders WHERE round <= ? "
            "GROUP BY client", (last_closed,),
        ).fetchall()  # fmt: skip
        total = conn.execute(
            "SELECT total FROM owner_statistics WHERE round <= ? ORDER BY round DESC LIMIT 1",
            (last_closed,),
        ).fetchone()
    devices = (
        0 if total is None else int(unpack(bytes(total[0]), max_bytes=len(total[0]))["devices"])
    )
    return {str(c): int(r) for c, r in held}, devices


def _sleep_until(at: float, tick: Callable[[], None]) -> None:
    while (left := at - time.time()) > 0:
        time.sleep(min(1.0, left))  # a memory sample and a liveness check a second
        tick()


def run(*, devices: int = DEVICES) -> dict[str, float]:
    with small_zoo() as bundle, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "mosquitto").mkdir()
        broker = MosquittoBroker(
            extra_config=f"persistence true\npersistence_location {root / 'mosquitto'}/\n"
            "autosave_interval 1\n"
        ).start()
        port = broker.address.port
        slow = FaultProxy((broker.address.host, port), delay_s=LATENCY_S)
        cut = FaultProxy((broker.address.host, port))
        n_slow, n_cut = devices // 4, devices // 10
        groups = (Group("direct", devices - n_slow - n_cut, port), Group("slow", n_slow, slow.port),
                  Group("cut", n_cut, cut.port))  # fmt: skip
        fleet = AgentFleet(root / "run", bundle=bundle, groups=groups, broker_port=port,
                           coordinator=coordinator(devices))  # fmt: skip
        state = fleet.spec.layout.coordinator
        db = state / "coordinator.sqlite3"
        tap = ReceiptTap(port)
        tier = Tier(fleet.config, fleet.logs)
        memory = FleetMemory()

        def tick() -> None:
            fleet.alive()
            memory.pids = [p for p in (broker.pid, *tier.pids(), *fleet.pids()) if p]
            memory.sample()

        faults: dict[str, float] = {}
        try:
            fleet.start()
            fleet.wait_online(port, tick)
            print(f"  {len(fleet.names)} agents online", file=sys.stderr)
            start = time.time()
            heal_at = dict((f, at) for at, f in SCHEDULE)["partition"] + PARTITION_S
            healed = False
            for at, fault in SCHEDULE:
                # The schedule itself: faults at fixed seconds from the start.
                _sleep_until(start + at, tick)
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
            _sleep_until(start + heal_at, tick)
            cut.heal()
            faults["partition_healed"] = time.time()
            last = max(faults.values())
            deadline = time.time() + 300
            while not any(c > last for _, _, c in _closed_rounds(db)):
                if time.time() > deadline:
                    raise TimeoutError("no round closed after the last fault")
                _sleep_until(time.time() + 0.5, tick)  # another process's database
        finally:
            fleet.stop()
            tier.stop()
            time.sleep(1.0)  # the last receipts reach the tap
            receipts = tap.close()
            slow.close()
            cut.close()
            broker.stop()
        stored = fleet.stored_statistics()
        rows = _worker_rows(state)
        closed = _closed_rounds(db)
        closed_rounds = {r for r, _, _ in closed}
        held, devices = _statistics_held(db, max(closed_rounds, default=-1))
        lost = {k for k, d in receipts.items() if d not in rows.get(k, set())}
        lost |= {
            k for k in stored
            if k not in rows or (k[1] in closed_rounds and held.get(k[2]) != k[1])
        }  # fmt: skip
        results = {
            "reliability.fault_matrix_real_agents": 1.0,
            "reliability.fault_matrix_devices": float(len(fleet.names)),
            "reliability.fault_matrix_receipted": float(len(receipts.keys() | stored.keys())),
            "reliability.fault_matrix_statistics_stored": float(len(stored)),
            "reliability.fault_matrix_lost": float(len(lost)),
            "reliability.fault_matrix_double_counted": float(
                _double_counted(db, rows) + max(0, devices - len(held))
            ),
            "reliability.fault_matrix_rounds_closed": float(len(closed)),
            "reliability.fault_matrix_worst_round_over_deadline_s": max(c - o for _, o, c in closed)
            - TIMEOUT_S,
            "reliability.fault_matrix_peak_mb": memory.peak_mb,
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
