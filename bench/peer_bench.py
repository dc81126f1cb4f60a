"""ProtoFleet next to Flower's simulation engine on one workload, in one run: 1,000
clients of 100 samples, each training the same head and linear classifier on the same
cached features (digits-5 through the zoo's 192-d digit backbone) for the same epoch,
FedAvg every round (bench/peer_workload.py), each half in a process of its own. Flower
runs from the ``peer`` extra; without it the key is skipped and said to be, never filled
from an earlier run."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.fleet_bench import median_round_s
from bench.flower_peer import flower_fedavg_round_seconds, missing_modules
from bench.one_backbone import ensure_one_backbone, pooled_features
from bench.peer_workload import Workload, load_workload, save_workload
from edge_agent.train_config import TrainConfig
from fleet.engine.batch import FleetFeatures
from fleet.transports.collect import round_seconds
from fleet.transports.spec import RunSpec
from fleet.transports.vector import train_vector

#: The workload of ``fleet.speedup_vs_flower``.
CLIENTS, PER_CLIENT, ROUNDS = 1000, 100, 3


def zoo_workload() -> Workload:
    """The cached features of 1,000 digits-5 clients (pooled from 50 rendered ones)."""
    data = pooled_features(ensure_one_backbone(), clients=CLIENTS, train=PER_CLIENT, test=1)
    return Workload(features=data.features, train_index=data.train_index,
                    train_labels=data.train_labels, num_classes=10, epochs=1, batch_size=32,
                    seed=0)  # fmt: skip


def protofleet_round_seconds(workload: Workload, *, rounds: int, root: Path) -> float:
    """The median round after the first of ``workload`` on the vector engine, against the
    coordinator's round manager and store."""
    index = tuple(workload.train_index)
    labels = tuple(workload.train_labels)
    data = FleetFeatures(features=workload.features, train_index=index, train_labels=labels,
                         test_index=index, test_labels=labels)  # fmt: skip
    spec = RunSpec(method="fedavg", rounds=rounds, bundle=root, out=root / "protofleet",
                   transport="vector", epochs=workload.epochs, progress=False)  # fmt: skip
    # FedAvg's clients start from one head, as Flower's from the server's parameters; and
    # like Flower's (no evaluation rounds) they train and send, without scoring a test set.
    train_vector(spec, data, classes=tuple(str(c) for c in range(workload.num_classes)),
                 bundle_id=hashlib.sha256(b"peer-workload").hexdigest(),
                 feature_dim=workload.dim,
                 cfg=TrainConfig(epochs=workload.epochs, batch_size=workload.batch_size),
                 names=[f"client-{i:05d}" for i in range(data.clients)],
                 seeds=([workload.seed + i for i in range(data.clients)],
                        [workload.seed] * data.clients),
                 evaluate=False)  # fmt: skip
    return median_round_s(round_seconds(spec), after_first=True)


def side_by_side() -> dict[str, float]:
    """Each half in a fresh process of its own, ProtoFleet's then Flower's, on the one
    workload built here: neither runs beside what the other left (Flower returns while
    its actors are still exiting; a process that ran anything keeps its heap)."""
    if missing_modules():
        print("  fleet.speedup_vs_flower skipped: Flower is not installed "
              "(pip install -e '.[peer]')", file=sys.stderr)  # fmt: skip
        return {}
    with tempfile.TemporaryDirectory(prefix="protofleet-peer-") as tmp:
        saved = Path(tmp) / "workload.npz"
        save_workload(zoo_workload(), saved)
        ours = _half("protofleet", saved)
        flower = _half("flower", saved)
    return {
        "fleet.flower_1000_round_s": flower,
        "fleet.protofleet_1000_fedavg_round_s": ours,
        "fleet.speedup_vs_flower": flower / ours,
    }


HALVES = ("protofleet", "flower")


def _half(half: str, saved: Path) -> float:
    """The median round of one half, measured by a child process (``_child``)."""
    done = subprocess.run([sys.executable, "-m", "bench.peer_bench", half, str(saved)],
                          stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
    return float(json.loads(done.stdout.strip().splitlines()[-1])["round_s"])


def _child(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in HALVES:
        print(f"usage: python -m bench.peer_bench {{{','.join(HALVES)}}} WORKLOAD.npz",
              file=sys.stderr)  # fmt: skip
        return 2
    workload = load_workload(Path(argv[1]))
    if argv[0] == "flower":
        seconds = flower_fedavg_round_seconds(workload, rounds=ROUNDS)
        if seconds is None:
            print("Flower's simulation engine is not installed", file=sys.stderr)
            return 1
    else:
        with tempfile.TemporaryDirectory(prefix="protofleet-peer-") as tmp:
            seconds = protofleet_round_seconds(workload, rounds=ROUNDS, root=Path(tmp))
    print(json.dumps({"round_s": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
