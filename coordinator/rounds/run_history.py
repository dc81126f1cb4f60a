"""The runs a coordinator's state folder has held, kept beside the database in a small
JSON file (``coordinator.sqlite3.runs``): a database that is missing while this file lists
earlier runs was lost, which the round manager says out loud; a first start says so
quietly. Written atomically; a damaged file is read as no history (it only decides how
loudly a new run is announced)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.files import atomic_write

#: The most recent runs kept: enough to name what was lost.
KEEP = 20


@dataclass(frozen=True)
class RunHistory:
    path: Path

    @classmethod
    def beside(cls, database: Path) -> RunHistory:
        return cls(path=database.with_name(database.name + ".runs"))

    def runs(self) -> list[dict[str, object]]:
        """The runs recorded, oldest first ({"run": id, "started": Unix seconds})."""
        try:
            data = json.loads(self.path.read_bytes())
        except (OSError, ValueError):
            return []
        return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []

    def add(self, run: str, started: float) -> None:
        runs = [*self.runs(), {"run": run, "started": started}][-KEEP:]
        atomic_write(self.path, json.dumps(runs, indent=1).encode())
