"""Agent test fixtures: digits-5 data for a device, its configuration (with a privacy
mechanism, for the privacy tests), and the round announcements it answers."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from edge_agent.config import AgentConfig, DataSettings
from edge_agent.privacy.settings import PrivacySettings
from edge_agent.train_config import TrainConfig
from fleet.data.digits5 import domain_data
from protocol import RoundAnnouncement
from runtime.security import AgentSecurity
from runtime.transport import MqttSettings

CLASSES = tuple(str(i) for i in range(10))


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


def dp_config(
    root: Path,
    bundle: Path,
    *,
    epsilon: float,
    mechanism: str = "dp",
    seed: int | None = 3,
    train: Path | None = None,
) -> AgentConfig:
    """A device under a formal mechanism: 120 training samples, a public bound of 120;
    ``seed``: replayable noise (None: secret)."""
    base = agent_config(root, bundle, agent_id="dev-dp", domain="clean")
    return replace(
        base,
        data=replace(base.data, train=train or base.data.train),
        train=TrainConfig(out_dim=32, norm="group" if mechanism == "dp" else "batch"),
        privacy=PrivacySettings(
            mechanism=mechanism,
            epsilon=epsilon,
            dataset_size=120,
            sgd_noise_multiplier=1.0,
            release_noise_multiplier=2.0,
            reproducible_noise_seed=seed,
        ),
    )


#: The coordinator run the test announcements name, and when it began.
RUN, RUN_STARTED = "0123456789abcdef", 1_700_000_000.0


def announcement(
    bundle_id: str,
    round_: int,
    method: str = "fedpcl",
    dim: int = 32,
    *,
    announced_dim: int | None = None,
) -> RoundAnnouncement:
    """Round 0 bare; later rounds carry global prototypes of ``dim`` (the head's; the
    features' under dp-features; 0 for none), so DP-SGD trains FedPCL's own objective
    (round 0 falls back to cross-entropy). The announced dimension is ``dim`` (32 with
    none), or ``announced_dim``: the device's."""  # fmt: skip
    globals_: dict[str, object] = {}
    if round_ > 0 and dim:
        protos = np.random.default_rng(round_).normal(size=(10, dim)).astype(np.float32)
        protos /= np.linalg.norm(protos, axis=1, keepdims=True)
        globals_ = {"global_classes": tuple(range(10)), "global_prototypes": protos}
    return RoundAnnouncement(
        fleet="lab", round=round_, run=RUN, run_started=RUN_STARTED, bundle=bundle_id,
        method=method, classes=CLASSES, dim=announced_dim or dim or 32,
        deadline=time.time() + 600, params={"final": False}, **globals_,  # type: ignore[arg-type]
    )  # fmt: skip
