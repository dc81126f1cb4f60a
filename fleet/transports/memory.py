"""The ``memory`` transport: every agent and the coordinator's round manager (with its
SQLite store) in this process, the messages handed over as the same wire bytes, for
sweeps with 1,000 clients."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from coordinator.config import CoordinatorConfig
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import Store
from edge_agent.agent import Agent
from edge_agent.config import AgentConfig
from export.runtime import BackboneRuntime, RuntimeSettings
from fleet.engine.evaluation import FleetEvaluator
from fleet.transports.procmem import peak_self_mb, reset_peak
from fleet.transports.progress import log_round, progress_bar
from fleet.transports.spec import RunSpec
from protocol import DEFAULT_MAX_PAYLOAD_BYTES, RoundAnnouncement
from runtime.faults import crash_point
from runtime.settings import build


def run_memory(
    spec: RunSpec,
    agents: list[dict[str, Any]],
    coord: dict[str, Any],
    *,
    impostors: Mapping[str, type[Agent]] | None = None,
) -> tuple[float, int]:
    """The run on one torch thread (many agents share the cores), the caller's thread
    count given back after it: a process that goes on (a sweep, a test session) computes
    as it did before, bit for bit. ``impostors`` runs the named agents as another class
    (a compromised device's, for the reliability benchmark) with their own keys."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_memory(spec, agents, coord, impostors or {})
    finally:
        torch.set_num_threads(before)


def _run_memory(
    spec: RunSpec,
    agents: list[dict[str, Any]],
    coord: dict[str, Any],
    impostors: Mapping[str, type[Agent]],
) -> tuple[float, int]:
    reset_peak()
    runtime = BackboneRuntime(spec.bundle, settings=RuntimeSettings(intra_op_threads=1))
    live = []
    with progress_bar(spec, len(agents), f"{spec.method}: starting agents", "agent") as bar:
        for tables in agents:
            agent_cfg = build(AgentConfig, tables)
            kind = impostors.get(agent_cfg.agent_id, Agent)
            live.append(kind(agent_cfg, runtime=runtime, evaluator=FleetEvaluator))
            bar.update()
    # The deployed payload limits: an announcement above the agents' is refused by the
    # coordinator, and decoded here under their limit as a device would.
    cfg = build(CoordinatorConfig, coord)
    limit = min((a.cfg.mqtt.max_payload_bytes for a in live), default=DEFAULT_MAX_PAYLOAD_BYTES)
    store = Store(cfg.database, synchronous=cfg.sqlite_synchronous)
    try:
        manager = RoundManager(config=cfg, store=store, metrics=Metrics())
        with progress_bar(spec, spec.rounds, f"{spec.method}: rounds", "round") as bar:
            while True:
                wire = manager.announcement.to_wire()
                announcement = RoundAnnouncement.from_wire(wire, max_bytes=limit)
                for agent in live:
                    decision = agent.handle(announcement, received_bytes=len(wire))
                    if decision.payload is not None:
                        outcome = manager.offer(decision.payload, topic_client=agent.cfg.agent_id)
                        if not outcome.accepted:
                            raise RuntimeError(
                                f"the coordinator rejected {agent.cfg.agent_id}: {outcome.reason}"
                            )
                        agent.state.mark_published(announcement.round)
                        agent.confirmed(announcement.round)
                if manager.done:
                    break
                if manager.poll() is None:
                    raise RuntimeError(f"round {announcement.round} did not close")
                bar.update()
                log_round(spec, announcement.round + 1)
                # Durability tests stop a sweep here, mid-run, as a crash would.
                crash_point(f"fleet:{spec.method}:round_closed")
    finally:
        store.close()
    return peak_self_mb(), runtime.samples_processed
