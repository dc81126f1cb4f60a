"""The coordinator's configuration: a TOML file mapped onto frozen dataclasses.

coordinator/coordinator.toml (``edge-coordinator example-config``) is a commented example
of every key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from coordinator.strategies import RobustOptions, available, make_strategy
from protocol import validate_id
from protocol.settings import load_config
from protocol.transport import MqttSettings

Scalar = bool | int | float | str


@dataclass(frozen=True)
class ModelSettings:
    """What the fleet trains: announced to every device in each round."""

    method: str = "fedpcl"
    bundle: str = "unset"
    classes: tuple[str, ...] = tuple(str(i) for i in range(10))
    dim: int = 256
    #: Client-side hyperparameters (tau, epochs, ...) passed through in the announcement.
    params: Mapping[str, Scalar] = field(default_factory=dict)
    #: Server-side strategy parameters, e.g. ``weighting = "paper"`` for FedPCL.
    strategy: Mapping[str, Scalar] = field(default_factory=dict)
    announce_dtype: Literal["f2", "f4"] = "f4"

    def __post_init__(self) -> None:
        if self.method not in available():
            raise ValueError(f"unknown method {self.method!r}; available: {', '.join(available())}")
        if not self.classes:
            raise ValueError("classes must not be empty")
        if len(set(self.classes)) != len(self.classes):
            raise ValueError("classes must be unique")
        if self.dim < 1:
            raise ValueError("dim must be positive")
        # Built once here so that a bad [model.strategy] is reported with the file's name
        # when the configuration is read, not by the first round.
        make_strategy(self.method, robust=None, **self.strategy)


@dataclass(frozen=True)
class RoundSettings:
    """When a round closes: ``min_clients`` updates and ``wait_after_quorum`` seconds more
    (or every allow-listed client), or the deadline with at least ``min_clients``;
    otherwise the deadline is extended by ``timeout_s``."""

    min_clients: int = 1
    wait_after_quorum_s: float = 5.0
    timeout_s: float = 300.0
    #: 0 runs forever; otherwise the coordinator publishes a final announcement and stops.
    max_rounds: int = 0
    allow_list: tuple[str, ...] = ()
    #: Closed rounds whose updates and announcements stay in the database; older rounds
    #: keep only their times, so the file stops growing. 0 keeps everything.
    keep_rounds: int = 10

    def __post_init__(self) -> None:
        if self.min_clients < 1:
            raise ValueError("min_clients must be at least 1")
        if self.wait_after_quorum_s < 0 or self.timeout_s <= 0:
            raise ValueError("wait_after_quorum_s must be >= 0 and timeout_s > 0")
        if self.max_rounds < 0:
            raise ValueError("max_rounds must be >= 0")
        if self.keep_rounds < 0:
            raise ValueError("keep_rounds must be >= 0 (0 keeps every round)")
        for client in self.allow_list:
            validate_id(client, field="rounds.allow_list")
        if self.allow_list and self.min_clients > len(self.allow_list):
            raise ValueError("min_clients exceeds the number of allow-listed clients")


@dataclass(frozen=True)
class MetricsSettings:
    port: int = 0  # 0 disables the Prometheus endpoint
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"metrics.port must be 0-65535 (0: no endpoint), got {self.port}")


@dataclass(frozen=True)
class CoordinatorConfig:
    fleet: str
    state_dir: Path
    coordinator_id: str = "coordinator"
    sqlite_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    model: ModelSettings = field(default_factory=ModelSettings)
    rounds: RoundSettings = field(default_factory=RoundSettings)
    robust: RobustOptions = field(default_factory=RobustOptions)
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)

    def __post_init__(self) -> None:
        validate_id(self.fleet, field="fleet")
        validate_id(self.coordinator_id, field="coordinator_id")

    @property
    def database(self) -> Path:
        return self.state_dir / "coordinator.sqlite3"

    @property
    def run_lock(self) -> Path:
        """Held by the running coordinator (``protocol.runlock``)."""
        return self.database.with_name(self.database.name + ".lock")


def load(path: Path) -> CoordinatorConfig:
    return load_config(CoordinatorConfig, path)
