"""Agent test fixtures: digits-5 data for a device, and its configuration."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_agent.config import AgentConfig, DataSettings
from edge_agent.train_config import TrainConfig
from fleet.data.digits5 import domain_data
from runtime.security import AgentSecurity
from runtime.transport import MqttSettings


def digits_npz(folder: Path, domain: str, *, start: int, count: int) -> Path:
    x, y = domain_data(domain, indices=np.arange(start, start + count))
    path = folder / f"{domain}-{start}.npz"
    np.savez(path, x=(x * 255).astype(np.uint8), y=y)
    return path


def agent_config(
    root: Path,
    bundle: Path,
    *,
    agent_id: str,
    domain: str,
    method: str = "fedpcl",
    port: int = 1883,
) -> AgentConfig:
    root.mkdir(parents=True, exist_ok=True)
    return AgentConfig(
        agent_id=agent_id,
        fleet="lab",
        state_dir=root / "state",
        bundle=bundle,
        data=DataSettings(
            train=digits_npz(root, domain, start=0, count=120),
            test=digits_npz(root, domain, start=1000, count=60),
        ),
        method=method,
        train=TrainConfig(out_dim=32),
        mqtt=MqttSettings(port=port),
        # Signatures have their tests (test_signatures.py); these are about other things.
        security=AgentSecurity(insecure=True),
    )
