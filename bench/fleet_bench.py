"""Fleet benchmarks: 1,000 clients in memory, 100 agents over Mosquitto, and the traffic
of FedPCL next to FedAvg, all with the full zoo bundle on digits-5 feature shift."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.export_bench import ZOO, ensure_zoo
from fleet.data.partition import digits5
from fleet.report.summary import run_summary
from fleet.transports import runner
from fleet.transports.spec import RunSpec


def _fleet(root: Path, *, clients: int, rounds: int, transport: str, method: str = "fedpcl",
           workers: int = 4, train: int = 20, test: int = 20) -> dict:  # fmt: skip
    partition = digits5(clients=clients, split="feature", seed=0, train=train, test=test)
    spec = RunSpec(method=method, rounds=rounds, bundle=ZOO, out=root / f"{method}-{clients}-{transport}",
                   transport=transport, workers=workers, progress=True)  # fmt: skip
    return run_summary(runner.run(spec, partition))


def median_round_s(seconds: Sequence[float], *, after_first: bool = False) -> float:
    """The median round (unclosed rounds, NaN, left out), so one slow fsync burst does not
    decide a figure; ``after_first`` leaves out round 0 too (FedPCL's announces no
    prototypes yet) when later rounds exist."""
    times = [t for t in seconds if not math.isnan(t)]
    if after_first and len(seconds) > 1:
        times = [t for t in seconds[1:] if not math.isnan(t)] or times
    times.sort()
    return times[len(times) // 2]


def _steady_round_s(summary: dict) -> float:
    # Round 0 includes nothing extra (agents start before it).
    return median_round_s(summary["round_seconds"])


def run() -> dict[str, float]:
    ensure_zoo()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="protofleet-fleet-bench-") as tmp:
        root = Path(tmp)
        # The MQTT fleet first: its peak counts this process's resident memory, which
        # after the 1,000 in-process clients stays high (freed heap is not returned).
        mqtt = _fleet(root, clients=100, rounds=3, transport="mqtt")
        out["fleet.mqtt_100_round_s"] = _steady_round_s(mqtt)
        out["fleet.mqtt_100_peak_mb"] = mqtt["peak_mb"]
        memory = _fleet(root, clients=1000, rounds=5, transport="memory")
        out["fleet.memory_1000_round_s"] = _steady_round_s(memory)
        out["fleet.memory_1000_peak_mb"] = memory["peak_mb"]
        out["fleet.memory_1000_final_mean_acc"] = memory["final_mean"]
        out["fleet.bytes_up_per_client_round_fedpcl"] = mqtt["bytes_up_per_client_round"]
        out["fleet.bytes_down_per_client_round_fedpcl"] = mqtt["bytes_down_per_client_round"]
        fedavg = _fleet(root, clients=5, rounds=2, transport="mqtt", method="fedavg", workers=1)
        out["fleet.bytes_up_per_client_round_fedavg"] = fedavg["bytes_up_per_client_round"]
        out["fleet.bytes_up_fedavg_over_fedpcl"] = (
            fedavg["bytes_up_per_client_round"] / mqtt["bytes_up_per_client_round"]
        )
    return out
