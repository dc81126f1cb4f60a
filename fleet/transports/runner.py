"""Run one simulated fleet: the real agent and coordinator code, over MQTT
(fleet/transports/mqtt.py) or in memory (fleet/transports/memory.py).

Either way every agent evaluates itself on its own test split each round and keeps the
record in its state directory; :func:`~fleet.transports.collect.collect` reads the run back from
those records and the coordinator's store.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from edge_agent.methods import device_method
from fleet.data.partition import Partition
from fleet.transports.collect import collect, round_seconds
from fleet.transports.configs import (
    agent_tables,
    coordinator_tables,
    fleet_keys,
    prototype_dim,
    to_toml,
)
from fleet.transports.memory import run_memory
from fleet.transports.mqtt import run_mqtt
from fleet.transports.spec import RunResult, RunSpec
from runtime.cliutil import UsageError


def run(spec: RunSpec, partition: Partition) -> RunResult:
    from export import bundle as bundle_mod
    from export.errors import BundleError

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
    spec.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if spec.transport == "vector":
        return _run_vector(spec, partition, bundle, started)
    agents: list[dict[str, Any]] = []
    keys = fleet_keys(spec.out / "keys", [c.name for c in partition.clients])
    for i, client in enumerate(partition.clients):
        tables = agent_tables(
            spec, client, spec.out / "clients" / client.name, partition.classes, i
        )
        tables["security"] = keys.agent_table(client.name)
        # Written for both transports: reports and users can reopen any agent from it.
        (spec.out / "clients" / client.name / "agent.toml").write_text(to_toml(tables))
        agents.append(tables)
    coord = coordinator_tables(spec, bundle.id, partition.classes, len(agents),
                                dim=prototype_dim(spec, bundle.feature_dim),
                                feature_dim=bundle.feature_dim)  # fmt: skip
    coord["security"] = keys.coordinator_table()
    samples = None
    if spec.transport == "memory":
        peak, samples = run_memory(spec, agents, coord)
    else:
        peak = run_mqtt(spec, agents, coord)
    result = collect(spec, partition, peak_mb=peak, wall=time.perf_counter() - started)
    return replace(result, backbone_samples=samples)


def _run_vector(spec: RunSpec, partition: Partition, bundle: Any, started: float) -> RunResult:
    """No agent files or keys: the vector engine holds every client in this process."""
    from fleet.engine.batch import unsupported
    from fleet.transports.vector import run_vector

    refusal = unsupported(spec.method)
    if refusal is not None:
        raise UsageError(refusal)
    if spec.privacy and device_method(spec.method).trains_head:
        raise UsageError(
            "the vector transport trains without a privacy mechanism: run privacy "
            "experiments with --transport memory or mqtt (or a closed-form method)"
        )
    records, peak = run_vector(spec, partition, bundle)
    wall = time.perf_counter() - started
    return RunResult(spec, tuple(records), round_seconds(spec), peak, wall)
