"""Run one simulated fleet: the real agent and coordinator code, over MQTT
(fleet/transports/mqtt.py) or in memory (fleet/transports/memory.py), or every client
batched by the vector engine (fleet/transports/vector.py).

Over MQTT or in memory every agent evaluates itself on its own test split each round and
keeps the record in its state directory; :func:`~fleet.transports.collect.collect` reads
the run back from those records and the coordinator's store.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from edge_agent.methods import device_method
from export import bundle as bundle_mod
from export.errors import BundleError
from fleet.data.partition import Partition
from fleet.transports.collect import collect, round_seconds
from fleet.transports.configs import (
    agent_tables,
    announcement_refusal,
    coordinator_tables,
    fleet_keys,
    prototype_dim,
    write_config,
)
from fleet.transports.mqtt import run_mqtt
from fleet.transports.secure import public_settings
from fleet.transports.spec import RunResult, RunSpec
from runtime.cliutil import UsageError
from secagg.fleet import SecureAggregation


def run(spec: RunSpec, partition: Partition) -> RunResult:
    try:
        bundle = bundle_mod.load(spec.bundle)
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    # The agents' and coordinator's files hold absolute paths: a relative one in a config
    # file is read from that file's folder, not from here.
    spec = replace(
        spec,
        out=spec.out.absolute(),
        bundle=spec.bundle.absolute(),
        feature_cache=spec.feature_cache and spec.feature_cache.absolute(),
    )
    names = [c.name for c in partition.clients]
    refused = announcement_refusal(spec, partition.classes, names, feature_dim=bundle.feature_dim)
    if refused is not None:
        raise UsageError(refused)
    secure = secure_table(spec, partition, feature_dim=bundle.feature_dim)
    spec.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if spec.transport == "vector":
        return _run_vector(spec, partition, bundle, started, secure=secure)
    agents, coord = fleet_tables(spec, partition, bundle, secure=secure)
    samples = None
    if spec.transport == "memory":
        # torch: only a run in this process pays for it, not edge-fleet's option checks.
        from fleet.transports.memory import run_memory

        peak, samples = run_memory(spec, list(agents.values()), coord)
    else:
        peak = run_mqtt(spec, agents, coord)
    result = collect(spec, partition, peak_mb=peak, wall=time.perf_counter() - started)
    return replace(result, backbone_samples=samples, secure=secure)


def secure_table(
    spec: RunSpec, partition: Partition, *, feature_dim: int
) -> SecureAggregation | None:
    """The fleet's public [secure_aggregation] table under --secure-aggregation, from the
    partition's public sizes (fleet/transports/secure.py); None for a plain run."""
    if not spec.secure_aggregation:
        return None
    return public_settings(
        spec, clients=len(partition.clients),
        largest=max(len(c.train_y) for c in partition.clients),
        k=prototype_dim(spec, feature_dim), classes=len(partition.classes),
    )  # fmt: skip


def fleet_tables(
    spec: RunSpec, partition: Partition, bundle: Any, *, secure: SecureAggregation | None = None
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every agent's configuration tables by name, and the coordinator's, with the fleet's
    keys made (``secure``: the fleet's [secure_aggregation] table). A memory run's agent
    files are written here, as an MQTT run's are: reports and users reopen any agent from
    them."""
    layout = spec.layout
    keys = fleet_keys(layout.keys, [c.name for c in partition.clients])
    agents = {
        client.name: agent_tables(spec, client, classes=partition.classes, index=i,
                                  security=keys.agent_table(client.name), secure=secure)
        for i, client in enumerate(partition.clients)
    }  # fmt: skip
    coord = coordinator_tables(spec, bundle.id, partition.classes, len(agents),
                               dim=prototype_dim(spec, bundle.feature_dim),
                               feature_dim=bundle.feature_dim,
                               security=keys.coordinator_table(), secure=secure)  # fmt: skip
    if spec.transport == "memory":
        for name, tables in agents.items():
            write_config(layout.agent_config(name), tables)
    return agents, coord


def vector_refusal(method: str) -> str | None:
    """Why the vector transport cannot run ``method``, or None if it can."""
    # torch: the vector engine's module; only a vector run (or its option check) pays for it.
    from fleet.engine.batch import unsupported

    return unsupported(method)


def _run_vector(
    spec: RunSpec,
    partition: Partition,
    bundle: Any,
    started: float,
    *,
    secure: SecureAggregation | None,
) -> RunResult:
    """No agent files or keys: the vector engine holds every client in this process."""
    refusal = vector_refusal(spec.method)
    if refusal is not None:
        raise UsageError(refusal)
    if spec.privacy and device_method(spec.method).trains_head:
        raise UsageError(
            "the vector transport trains without a privacy mechanism: run privacy "
            "experiments with --transport memory or mqtt (or a closed-form method)"
        )
    # torch: the vector engine; only a vector run pays for it.
    from fleet.transports.vector import run_vector

    records, peak = run_vector(spec, partition, bundle, secure=secure)
    wall = time.perf_counter() - started
    return RunResult(spec=spec, clients=tuple(records), round_seconds=round_seconds(spec),
                     peak_mb=peak, wall_seconds=wall, secure=secure)  # fmt: skip
