"""The shipped example configurations and the dataclasses each is rendered from
(runtime/example_config.py renders them). After adding a key, rewrite them with
``python -m tests.example_configs``; tests/test_example_config.py holds them equal."""

from __future__ import annotations

import sys
from pathlib import Path

from coordinator.config import CoordinatorConfig
from edge_agent.config import AgentConfig
from runtime.example_config import render


def shipped() -> dict[Path, type]:
    """The shipped example files and the dataclass each is rendered from."""
    root = Path(__file__).resolve().parent.parent
    return {
        root / "edge_agent" / "agent.toml": AgentConfig,
        root / "coordinator" / "coordinator.toml": CoordinatorConfig,
    }


def main() -> int:
    """Rewrite the shipped example files from their dataclasses (after adding a key)."""
    for path, cls in shipped().items():
        text = path.read_text(encoding="utf-8")
        rendered = render(cls, text)
        if rendered != text:
            path.write_text(rendered, encoding="utf-8")
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
