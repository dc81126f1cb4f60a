"""Where everything of one fleet run lies in its folder: the one place that spells the
layout, for the transports that write it and the reports and resumes that read it.

::

    clients/<name>/agent.toml   the agent's configuration (reopened by edge-agent and reports)
    clients/<name>/state/       the agent's state directory (edge_agent/state.py)
    clients/<name>/data/        its training and test split
    keys/                       the fleet's signing keys (fleet/transports/configs.py::FleetKeys)
    coordinator/                the coordinator's state directory and database
    coordinator.toml            the coordinator's configuration (mqtt transport)
    logs/                       the coordinator's and each worker's log and spec (mqtt)
    data/<name>/                a client's split as the pooled ceiling reads it
    feature-cache/              the backbones' features when no sweep shares its cache
    result.json                 the finished run, written last (fleet/cli/resume.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunLayout:
    """The paths of the run folder ``root``."""

    root: Path

    def client(self, name: str) -> Path:
        """The folder of the agent called ``name``."""
        return self.root / "clients" / name

    def agent_config(self, name: str) -> Path:
        return self.client(name) / "agent.toml"

    def agent_state(self, name: str) -> Path:
        return self.client(name) / "state"

    def agent_data(self, name: str) -> Path:
        return self.client(name) / "data"

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def coordinator(self) -> Path:
        """The coordinator's state directory (its database lies inside)."""
        return self.root / "coordinator"

    @property
    def coordinator_config(self) -> Path:
        return self.root / "coordinator.toml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def coordinator_log(self) -> Path:
        return self.logs / "coordinator.log"

    def worker_spec(self, index: int) -> Path:
        """What worker process ``index`` is to host (fleet/transports/worker.py)."""
        return self.logs / f"worker-{index}.json"

    def worker_log(self, index: int) -> Path:
        return self.logs / f"worker-{index}.log"

    def pooled_data(self, name: str) -> Path:
        """Client ``name``'s split as the pooled ceiling (fleet/report/central.py) saves it."""
        return self.root / "data" / name

    @property
    def feature_cache(self) -> Path:
        return self.root / "feature-cache"

    @property
    def result(self) -> Path:
        return self.root / "result.json"
