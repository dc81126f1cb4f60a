"""Fleets of thousands on the vector engine (``--transport vector``), each against the
real coordinator round manager and SQLite store:

- 10,000 FedPCL clients of 100 training images: seconds per round and peak memory, run in
  a child process so its peak is its own (this process keeps what earlier sections held);
- the traffic of FedPCL and FedAvg at 1,000 clients, up and down.

The same FedAvg workload in Flower's simulation engine and here, side by side, is a
section of its own (bench/peer_bench.py: the ``peer`` extra; skipped without it).

The 10,000-client fleet uses the zoo's 192-d digit backbone alone: a client's head with
its Adam moments is 3 x (D x 256) floats, 0.6 MB at D = 192 but 2.8 MB at the full zoo's
D = 896, which for 10,000 clients would be 28 GB (docs/scale.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.export_bench import ensure_zoo
from bench.fleet_bench import median_round_s
from bench.one_backbone import ensure_one_backbone, pooled_features
from edge_agent.train_config import TrainConfig
from export import bundle as bundle_mod
from fleet.transports.collect import round_seconds
from fleet.transports.procmem import peak_self_mb, reset_peak
from fleet.transports.spec import RunSpec
from fleet.transports.vector import train_vector

TEN_K = {"clients": 10_000, "train": 100, "test": 20, "rounds": 3}


def vector_fleet(
    root: Path, *, bundle_path: Path, method: str, clients: int, train: int, test: int,
    rounds: int, pool: int = 50,
) -> dict[str, Any]:  # fmt: skip
    """One vector-engine run on digits-5 feature shift, its clients pooled from ``pool``
    rendered ones; its records, round times and this process's peak."""
    reset_peak()
    bundle = bundle_mod.load(bundle_path)
    spec = RunSpec(method=method, rounds=rounds, bundle=bundle_path,
                   out=root / f"{method}-{clients}", transport="vector")  # fmt: skip
    data = pooled_features(bundle_path, clients=clients, train=train, test=test, pool=pool)
    records = train_vector(spec, data, classes=tuple(str(c) for c in range(10)),
                           bundle_id=bundle.id, feature_dim=bundle.feature_dim,
                           cfg=TrainConfig(), names=[f"client-{i:05d}" for i in range(clients)])  # fmt: skip
    last = records.scores["test_accuracy"][:, -1]
    return {
        "round_s": median_round_s(round_seconds(spec), after_first=True),
        "peak_mb": peak_self_mb(),
        "final_mean": float(np.nanmean(last)) if np.isfinite(last).any() else float("nan"),
        # Per client and round, in the round that moved the most (a steady round).
        "bytes_up": float(records.bytes_up.mean(axis=0).max()),
        "bytes_down": float(records.bytes_down.mean(axis=0).max()),
    }


def ten_thousand() -> dict[str, float]:
    """The 10,000-client FedPCL figures, measured in a child process."""
    done = subprocess.run([sys.executable, "-m", "bench.vector_bench", "ten-thousand"],
                          stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "fleet.memory_10k_round_s": result["round_s"],
        "fleet.memory_10k_peak_mb": result["peak_mb"],
        "fleet.memory_10k_final_mean_acc": result["final_mean"],
    }


def traffic(root: Path) -> dict[str, float]:
    """Bytes each way per client and round at 1,000 clients, full zoo."""
    runs = {
        method: vector_fleet(
            root, bundle_path=ensure_zoo(), method=method, clients=1000, train=20, test=20, rounds=2
        )
        for method in ("fedpcl", "fedavg")
    }
    total = {m: r["bytes_up"] + r["bytes_down"] for m, r in runs.items()}
    return {
        "fleet.bytes_up_per_client_round_fedpcl_1000": runs["fedpcl"]["bytes_up"],
        "fleet.bytes_down_per_client_round_fedpcl_1000": runs["fedpcl"]["bytes_down"],
        "fleet.bytes_up_per_client_round_fedavg_1000": runs["fedavg"]["bytes_up"],
        "fleet.bytes_down_per_client_round_fedavg_1000": runs["fedavg"]["bytes_down"],
        "fleet.bytes_total_fedavg_over_fedpcl": total["fedavg"] / total["fedpcl"],
    }


def run() -> dict[str, float]:
    out: dict[str, float] = {}
    ensure_one_backbone()
    out |= ten_thousand()
    with tempfile.TemporaryDirectory(prefix="protofleet-vector-bench-") as tmp:
        out |= traffic(Path(tmp))
    return out


def _child(argv: list[str]) -> int:
    if argv != ["ten-thousand"]:
        print("usage: python -m bench.vector_bench ten-thousand", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="protofleet-10k-") as tmp:
        result = vector_fleet(Path(tmp), bundle_path=ensure_one_backbone(), method="fedpcl",
                              clients=TEN_K["clients"], train=TEN_K["train"],
                              test=TEN_K["test"], rounds=TEN_K["rounds"])  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
