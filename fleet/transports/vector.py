"""The ``vector`` transport: a whole fleet trained by the vector engine
(:mod:`fleet.engine.batch`) against the real coordinator round manager and SQLite
store, in this process, the updates and announcements passing as wire bytes under the
deployed payload limits.

What differs from ``--transport memory``: no ``Agent`` objects, state folders or key
files (the updates are unsigned, as a coordinator without a ``[security]`` table takes
them), and a run cannot resume, so its store keeps each update's row but not its payload
(fleet/transports/vector_coordinator.py); what is the same: every client's math, the
coordinator's aggregation and the records the report reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from edge_agent.data import to_nchw_float
from edge_agent.features import FeatureCache
from edge_agent.inference import dense_globals
from edge_agent.methods import device_method
from edge_agent.train import Guidance
from edge_agent.train_config import TrainConfig
from export.runtime import BackboneRuntime, RuntimeSettings
from fleet.data.partition import Partition
from fleet.engine.batch import FleetFeatures, VectorEngine
from fleet.transports.configs import agent_seed, coordinator_tables, initial_seed, prototype_dim
from fleet.transports.procmem import peak_self_mb, reset_peak
from fleet.transports.progress import progress_bar
from fleet.transports.spec import FLEET, ClientRecord, RunSpec, train_table
from fleet.transports.vector_closed_form import drive_closed_form
from fleet.transports.vector_records import Records, drive_rounds
from protocol import PrivacyMeta, PrototypeUpdate, RoundAnnouncement
from runtime.settings import build
from secagg.fleet import SecureAggregation


def drive(
    engine: VectorEngine,
    *,
    spec: RunSpec,
    names: list[str],
    coord: dict[str, Any],
    bundle_id: str,
    observe: Callable[[RoundAnnouncement], None] | None = None,
) -> Records:
    """Run ``spec.rounds`` rounds of ``engine``'s clients against a coordinator built from
    ``coord`` (its tables); every client's scores and traffic per round. ``observe``: as
    :func:`fleet.transports.vector_records.drive_rounds` takes it."""
    records = Records(len(names), spec.rounds)

    def adopt(announcement: RoundAnnouncement) -> None:
        round_ = announcement.round
        if engine.record.wire.averaged:
            engine.adopt(announcement.extras)
        if engine.rule.from_server and round_ >= 1:
            globals_ = None
            if engine.rule.prototypes == "global":
                globals_ = dense_globals(
                    announcement, client=names[0], num_classes=engine.num_classes,
                    dim=engine.cfg.out_dim,
                )  # fmt: skip
            for k, score in enumerate(engine.from_server(globals_)):
                records.set(k, round_ - 1, {"test_accuracy": score})

    def updates(announcement: RoundAnnouncement) -> Iterator[tuple[int, bytes]]:
        # One client's view serves every client: the engine's methods announce one global
        # set to all (FedDBP's personalised sets are why it is not among them).
        guidance = Guidance.from_announcement(announcement, client=names[0],
                                              dim=engine.cfg.out_dim)  # fmt: skip
        return _trained(engine, guidance, names=names, bundle_id=bundle_id, records=records,
                        round_=announcement.round)  # fmt: skip

    drive_rounds(spec=spec, coord=coord, names=names, records=records, adopt=adopt,
                 updates=updates, observe=observe)  # fmt: skip
    return records


def _trained(engine: VectorEngine, guidance: Any, *, names: list[str], bundle_id: str,
             records: Records, round_: int) -> Iterator[tuple[int, bytes]]:  # fmt: skip
    """Every client's update of ``round_`` as its chunk finishes training, its scores
    recorded."""
    for k, result in engine.train_round(guidance):
        update = PrototypeUpdate(
            fleet=FLEET, round=round_, client=names[k], bundle=bundle_id,
            method=engine.method,
            classes=tuple(int(c) for c in result.release_classes),
            counts=tuple(int(c) for c in result.release_counts),
            prototypes=result.release_protos.astype(np.float16),
            extras=result.weights, privacy=PrivacyMeta(),
        )  # fmt: skip
        records.set(k, round_, result.scores)
        yield k, update.to_wire()


def features_of(spec: RunSpec, partition: Partition, bundle: Any) -> FleetFeatures:
    """Every client's images through the bundle's backbones once (through the shared
    feature cache when the run has one, so a compare's runs share it), as one matrix."""
    runtime = BackboneRuntime(bundle, settings=RuntimeSettings(intra_op_threads=1))
    cache = FeatureCache(spec.feature_cache, shared=True) if spec.feature_cache else None
    parts: list[np.ndarray] = []
    train_index: list[np.ndarray] = []
    test_index: list[np.ndarray] = []
    offset = 0
    with progress_bar(spec, len(partition.clients), f"{spec.method}: features", "client") as bar:
        for client in partition.clients:
            for images, labels, into in ((client.train_x, client.train_y, train_index),
                                         (client.test_x, client.test_y, test_index)):  # fmt: skip
                x = to_nchw_float(images, source=client.name)
                y = np.asarray(labels, np.int64)
                rows = (
                    cache.features(bundle.id, x, runtime.extract, dim=runtime.feature_dim, labels=y)
                    if cache is not None
                    else runtime.extract(x)
                )
                parts.append(np.asarray(rows, np.float32))
                into.append(np.arange(offset, offset + len(y)))
                offset += len(y)
            bar.update()
    return FleetFeatures(
        features=np.concatenate(parts),
        train_index=tuple(train_index),
        train_labels=tuple(np.asarray(c.train_y, np.int64) for c in partition.clients),
        test_index=tuple(test_index),
        test_labels=tuple(np.asarray(c.test_y, np.int64) for c in partition.clients),
    )


def client_seeds(spec: RunSpec, clients: int) -> tuple[list[int], list[int]]:
    """(seeds, initial seeds) as fleet.transports.configs.agent_tables gives the agents."""
    return (
        [agent_seed(spec, i) for i in range(clients)],
        [initial_seed(spec, i) for i in range(clients)],
    )


def train_vector(
    spec: RunSpec,
    data: FleetFeatures,
    *,
    classes: tuple[str, ...],
    bundle_id: str,
    feature_dim: int,
    cfg: TrainConfig,
    names: list[str],
    seeds: tuple[list[int], list[int]] | None = None,
    evaluate: bool = True,
    secure: SecureAggregation | None = None,
    observe: Callable[[RoundAnnouncement], None] | None = None,
) -> Records:
    """``spec.rounds`` rounds of ``data``'s clients (named ``names``) on the vector engine,
    against a coordinator built from ``spec`` as a run's would be: every vector run, the
    CLI's and the benchmarks', is set up here. ``seeds``: (seeds, initial seeds), by
    default the agents' (:func:`client_seeds`); ``secure``: the fleet's
    [secure_aggregation] table under --secure-aggregation; ``observe``: sees each
    announcement as the clients receive it (:func:`fleet.transports.vector_records.drive_rounds`)."""
    coord = coordinator_tables(spec, bundle_id, classes, data.clients, dim=cfg.out_dim,
                               feature_dim=feature_dim, secure=secure)  # fmt: skip
    # Updates from this process's own engine, unsigned: no key files for 10,000 devices.
    coord["security"] = {"insecure": True}
    if not device_method(spec.method).trains_head:
        coord["model"]["dim"] = prototype_dim(spec, feature_dim)
        return drive_closed_form(spec=spec, data=data, names=names, coord=coord,
                                 bundle_id=bundle_id, num_classes=len(classes),
                                 evaluate=evaluate, secure=secure, observe=observe)  # fmt: skip
    chosen, initial = seeds if seeds is not None else client_seeds(spec, data.clients)
    engine = VectorEngine(data=data, method=spec.method, num_classes=len(classes), cfg=cfg,
                          seeds=chosen, init_seeds=initial, evaluate=evaluate)  # fmt: skip
    return drive(engine, spec=spec, names=names, coord=coord, bundle_id=bundle_id,
                 observe=observe)  # fmt: skip


def run_vector(
    spec: RunSpec, partition: Partition, bundle: Any, *, secure: SecureAggregation | None = None
) -> tuple[list[ClientRecord], float]:
    """The run's client records and this process's peak resident MiB (``secure``: the
    fleet's [secure_aggregation] table under --secure-aggregation)."""
    reset_peak()
    data = features_of(spec, partition, bundle)
    names = [c.name for c in partition.clients]
    records = train_vector(spec, data, classes=partition.classes, bundle_id=bundle.id,
                           feature_dim=bundle.feature_dim,
                           cfg=build(TrainConfig, train_table(spec), prefix="train."),
                           names=names, secure=secure)  # fmt: skip
    out = [records.client(k, name=c.name, domain=c.domain) for k, c in enumerate(partition.clients)]
    return out, peak_self_mb()
