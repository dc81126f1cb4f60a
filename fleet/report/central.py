"""The ceiling of a comparison: one linear head trained on every client's data pooled.

With frozen backbones no federated method can do better than a single head that sees all
the training data at once (short of luck): it is what federation approximates without
moving data. It gets the same head architecture, optimiser and [train] settings as the
methods, with a plain linear classifier whatever the protocol, and the same budget in
epochs: ``rounds`` x ``epochs`` passes over the pooled data. After each of its "rounds" it
is scored by its classifier on every client's own test split, so its figures read like
the methods' (per client, per round; final and best).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from edge_agent import data as data_mod
from edge_agent import inference
from edge_agent.features import FeatureCache, cache_features
from edge_agent.methods import FLOOR
from edge_agent.train_config import TrainConfig
from export.runtime import BackboneRuntime, RuntimeSettings
from fleet.data.partition import Partition
from fleet.transports.spec import ClientRecord, RunResult, RunSpec, train_table
from runtime.settings import build

log = logging.getLogger(__name__)

#: The name a comparison gives it, and the [train] settings it always has.
CENTRAL = "central"
CENTRAL_TRAIN = {"classifier": "linear"}


def _features(
    spec: RunSpec, partition: Partition, runtime: BackboneRuntime
) -> list[tuple[np.ndarray, ...]]:
    """(train features, train labels, test features, test labels) per client, through the
    agents' own loader and feature cache: the sweep's methods filled it already."""
    cache = FeatureCache(spec.feature_cache or spec.layout.feature_cache, shared=True)
    out = []
    for client in partition.clients:
        train_path, test_path = client.save(spec.layout.pooled_data(client.name))
        parts: list[np.ndarray] = []
        for path, what in ((train_path, "training data"), (test_path, "test data")):
            data = data_mod.load(path, partition.classes)
            parts += [
                np.asarray(cache_features(cache, runtime.bundle.id, data, runtime, what=what)),
                data.labels,
            ]
        out.append(tuple(parts))
    return out


def run(spec: RunSpec, partition: Partition) -> RunResult:
    """Train and score the pooled head; ``spec.method`` is :data:`CENTRAL`."""
    # torch: the reports and edge-fleet's option checks read CENTRAL from this module; only
    # training the ceiling pays for torch.
    import torch

    from edge_agent.train import Guidance, LocalModel, make_optimiser, train_round

    started = time.perf_counter()
    spec.out.mkdir(parents=True, exist_ok=True)
    runtime = BackboneRuntime(spec.bundle, settings=RuntimeSettings(intra_op_threads=1))
    clients = _features(spec, partition, runtime)
    train_x = np.concatenate([c[0] for c in clients])  # (sum N_i, K*d_e)
    train_y = np.concatenate([c[1] for c in clients])
    cfg = build(TrainConfig, train_table(spec), prefix="train.")
    num_classes = len(partition.classes)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = LocalModel(in_dim=runtime.feature_dim, num_classes=num_classes, cfg=cfg)
    optimiser = make_optimiser(model, cfg)
    generator = torch.Generator().manual_seed(spec.seed)
    no_guidance = Guidance.empty(num_classes, cfg.out_dim)
    accuracy: list[list[float]] = [[] for _ in clients]
    seconds = []
    for _ in range(spec.rounds):
        tick = time.perf_counter()
        train_round(model, optimiser, train_x, train_y, method=FLOOR, guidance=no_guidance,
                    cfg=cfg, generator=generator)  # fmt: skip
        for i, (_, _, test_x, test_y) in enumerate(clients):
            outputs = inference.outputs_of(model, test_x)
            chosen = inference.RULES["classifier"](outputs, inference.References())
            accuracy[i].append(inference.accuracy(chosen, test_y))
        seconds.append(time.perf_counter() - tick)
    rounds = spec.rounds
    records = tuple(
        ClientRecord(
            name=client.name,
            domain=client.domain,
            accuracy=tuple(acc),
            accuracy_prototype=(None,) * rounds,
            accuracy_classifier=tuple(acc),
            bytes_up=(0,) * rounds,
            bytes_down=(0,) * rounds,
        )
        for client, acc in zip(partition.clients, accuracy, strict=True)
    )
    log.info("central: %d samples pooled, %d rounds", len(train_y), rounds)
    return RunResult(spec=spec, clients=records, round_seconds=tuple(seconds), peak_mb=0.0,
                     wall_seconds=time.perf_counter() - started)  # fmt: skip
