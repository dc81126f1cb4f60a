"""Fleet benchmarks: 1,000 clients in memory, 100 agents over Mosquitto, and the traffic
of FedPCL next to FedAvg, all with the full zoo bundle on digits-5 feature shift."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from bench.export_bench import ZOO, ensure_zoo
from fleet import runner
from fleet.partition import digits5
from fleet.report import run_summary
from fleet.spec import RunSpec


def _fleet(root: Path, *, clients: int, rounds: int, transport: str, method: str = "fedpcl",
           workers: int = 4, train: int = 20, test: int = 20) -> dict:  # fmt: skip
    partition = digits5(clients=clients, split="feature", seed=0, train=train, test=test)
    spec = RunSpec(method=method, rounds=rounds, bundle=ZOO, out=root / f"{method}-{clients}-{transport}",
                   transport=transport, workers=workers, progress=True)  # fmt: skip
    return run_summary(runner.run(spec, partition))


def _steady_round_s(summary: dict) -> float:
    # Round 0 includes nothing extra (agents start before it), but take the median to keep
    # one slow fsync burst from deciding the figure.
    times = sorted(t for t in summary["round_seconds"] if not math.isnan(t))
    return times[len(times) // 2]


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
