"""The agent's configuration: a TOML file mapped onto frozen dataclasses.
See docs/agent.toml for a commented example of every key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.train import LOSSES, TrainConfig
from export.runtime import RuntimeSettings
from protocol import validate_id
from protocol.settings import load_config
from protocol.transport import MqttSettings


@dataclass(frozen=True)
class DataSettings:
    """``train``/``test``: an .npz (x, y) or a folder of class subfolders."""

    train: Path
    test: Path | None = None
    image_size: int = 32  # folder images are resized to this square side


@dataclass(frozen=True)
class AgentConfig:
    agent_id: str
    fleet: str
    state_dir: Path
    bundle: Path
    data: DataSettings
    method: str = "fedpcl"
    classes: tuple[str, ...] = tuple(str(i) for i in range(10))
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    mqtt: MqttSettings = field(default_factory=MqttSettings)

    def __post_init__(self) -> None:
        validate_id(self.agent_id, field="agent_id")
        validate_id(self.fleet, field="fleet")
        if self.method not in LOSSES:
            raise ValueError(
                f"method {self.method!r} is not supported on the agent; use one of {', '.join(sorted(LOSSES))}"
            )
        if len(set(self.classes)) != len(self.classes) or not self.classes:
            raise ValueError("classes must be a non-empty list of unique names")


def load(path: Path) -> AgentConfig:
    return load_config(AgentConfig, path)
