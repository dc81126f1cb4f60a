"""Building blocks for coordinator tests: configs and stand-in client updates."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from coordinator.config import CoordinatorConfig, ModelSettings, RoundSettings
from protocol import PrototypeUpdate
from protocol.security import CoordinatorSecurity
from protocol.transport import MqttSettings

BUNDLE = "f" * 64
CLASSES = ("a", "b", "c")
DIM = 4


def config(
    state_dir: Path,
    *,
    method: str = "fedpcl",
    port: int = 1883,
    feature_dim: int = 0,
    **rounds: object,
) -> CoordinatorConfig:
    return CoordinatorConfig(
        fleet="lab",
        state_dir=state_dir,
        model=ModelSettings(
            method=method, bundle=BUNDLE, classes=CLASSES, dim=DIM, feature_dim=feature_dim
        ),
        rounds=RoundSettings(**rounds),  # type: ignore[arg-type]
        mqtt=MqttSettings(port=port),
        # Signatures have their tests (test_signatures.py); these are about other things.
        security=CoordinatorSecurity(insecure=True),
    )


def stand_in_update(
    client: int, round_: int, *, method: str = "fedpcl", seed: int = 0
) -> PrototypeUpdate:
    """A deterministic update: client i holds classes {i % 3, (i + 1) % 3}."""
    rng = np.random.default_rng(1000 * seed + 17 * client + round_)
    classes = sorted({client % 3, (client + 1) % 3})
    z = rng.normal(size=(len(classes), DIM))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return PrototypeUpdate(
        fleet="lab",
        round=round_,
        client=f"dev-{client}",
        bundle=BUNDLE,
        method=method,
        classes=tuple(classes),
        counts=tuple(int(c) for c in rng.integers(1, 50, size=len(classes))),
        prototypes=z.astype(np.float16),
    )


def hand_globals(updates: list[PrototypeUpdate]) -> dict[int, np.ndarray]:
    """FedPCL's default global prototypes, computed the slow obvious way."""
    sums: dict[int, np.ndarray] = {}
    totals: dict[int, float] = {}
    for u in updates:
        for c, n, p in zip(u.classes, u.counts, u.prototypes, strict=True):
            sums[c] = sums.get(c, np.zeros(DIM)) + n * p.astype(np.float64)
            totals[c] = totals.get(c, 0.0) + n
    return {c: sums[c] / totals[c] for c in sums}
