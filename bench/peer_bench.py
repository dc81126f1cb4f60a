"""ProtoFleet next to Flower's simulation engine on one workload, in one run: 1,000
clients of 100 samples, each training the same head and linear classifier on the same
cached features (digits-5 through the zoo's 192-d digit backbone) for the same epoch,
FedAvg every round (bench/peer_workload.py). Flower runs from the ``peer`` extra; without
it the key is skipped and said to be, never filled from an earlier run."""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

from bench.fleet_bench import median_round_s
from bench.peer_workload import Workload

#: The workload of ``fleet.speedup_vs_flower``.
CLIENTS, PER_CLIENT, ROUNDS = 1000, 100, 3


def zoo_workload() -> Workload:
    """The cached features of 1,000 digits-5 clients (pooled from 50 rendered ones)."""
    from bench.vector_bench import ensure_one_backbone, pooled_features

    data = pooled_features(ensure_one_backbone(), clients=CLIENTS, train=PER_CLIENT, test=1)
    return Workload(features=data.features, train_index=data.train_index,
                    train_labels=data.train_labels, num_classes=10, epochs=1, batch_size=32,
                    seed=0)  # fmt: skip


def protofleet_round_seconds(workload: Workload, *, rounds: int, root: Path) -> float:
    """The median round after the first of ``workload`` on the vector engine, against the
    coordinator's round manager and store."""
    from edge_agent.train_config import TrainConfig
    from fleet.collect import round_seconds
    from fleet.configs import coordinator_tables
    from fleet.spec import RunSpec
    from fleet.vector_engine import FleetFeatures, VectorEngine
    from fleet.vector_run import drive

    index = tuple(workload.train_index)
    labels = tuple(workload.train_labels)
    data = FleetFeatures(features=workload.features, train_index=index, train_labels=labels,
                         test_index=index, test_labels=labels)  # fmt: skip
    cfg = TrainConfig(epochs=workload.epochs, batch_size=workload.batch_size)
    spec = RunSpec(method="fedavg", rounds=rounds, bundle=root, out=root / "protofleet",
                   transport="vector", epochs=workload.epochs, progress=False)  # fmt: skip
    bundle_id = hashlib.sha256(b"peer-workload").hexdigest()
    classes = tuple(str(c) for c in range(workload.num_classes))
    coord = coordinator_tables(spec, bundle_id, classes, data.clients, dim=cfg.out_dim,
                               feature_dim=workload.features.shape[1])  # fmt: skip
    coord["security"] = {"insecure": True}
    # FedAvg's clients start from one head, as Flower's from the server's parameters; and
    # like Flower's (no evaluation rounds) they train and send, without scoring a test set.
    seeds = [workload.seed + i for i in range(data.clients)]
    engine = VectorEngine(data=data, method="fedavg", num_classes=workload.num_classes,
                          cfg=cfg, seeds=seeds, init_seeds=[workload.seed] * data.clients,
                          evaluate=False)  # fmt: skip
    names = [f"client-{i:05d}" for i in range(data.clients)]
    drive(engine, spec=spec, names=names, coord=coord, bundle_id=bundle_id)
    return median_round_s(round_seconds(spec), after_first=True)


def side_by_side() -> dict[str, float]:
    from bench.flower_peer import flower_fedavg_round_seconds

    workload = zoo_workload()
    flower = flower_fedavg_round_seconds(workload, rounds=ROUNDS)
    if flower is None:
        print("  fleet.speedup_vs_flower skipped: Flower is not installed "
              "(pip install -e '.[peer]')", file=sys.stderr)  # fmt: skip
        return {}
    with tempfile.TemporaryDirectory(prefix="protofleet-peer-") as tmp:
        ours = protofleet_round_seconds(workload, rounds=ROUNDS, root=Path(tmp))
    return {
        "fleet.flower_1000_round_s": flower,
        "fleet.protofleet_1000_fedavg_round_s": ours,
        "fleet.speedup_vs_flower": flower / ours,
    }
