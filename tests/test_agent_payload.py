"""A device whose updates could exceed the payload cap refuses to start, naming the fix,
instead of sending an update the coordinator refuses on every resend (docs/protocol.md,
Encoding)."""

from __future__ import annotations

import dataclasses

import pytest

from edge_agent.agent import Agent
from edge_agent.extras import largest_update_bytes
from edge_agent.state import StateDir
from tests.agent_helpers import agent_config, announcement


@pytest.mark.parametrize("method", ["fedpcl", "fedavg", "feddbp"])
def test_the_largest_update_bounds_a_real_one(small_zoo, tmp_path, method):
    cfg = agent_config(
        tmp_path / method, small_zoo, agent_id="dev-a", domain="clean", method=method
    )
    agent = Agent(cfg)
    decision = agent.handle(announcement(agent.bundle_id, 0, method=method))
    assert decision.payload is not None
    largest = largest_update_bytes(
        method=method, model=agent.model, fleet=cfg.fleet, client=cfg.agent_id,
        bundle=agent.bundle_id, num_classes=agent.num_classes, dim=agent.prototype_dim,
    )  # fmt: skip
    assert len(decision.payload) <= largest < len(decision.payload) + 1024


def test_a_device_whose_updates_cannot_fit_refuses_to_start(small_zoo, tmp_path):
    cfg = agent_config(tmp_path / "a", small_zoo, agent_id="dev-a", domain="clean", method="fedavg")
    tight = dataclasses.replace(cfg, mqtt=dataclasses.replace(cfg.mqtt, max_payload_bytes=4096))
    with pytest.raises(ValueError, match=r"above mqtt\.max_payload_bytes = 4,096"):
        Agent(tight)
    # Refused before any round: no update is stored to be sent again and again.
    assert StateDir(cfg.state_dir, agent_id="dev-a").pending_update() is None
