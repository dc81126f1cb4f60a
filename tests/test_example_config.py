"""``example-config``: rendered from the configuration dataclasses, so every key is listed
with its default; the shipped example files are what it prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.service.cli import main as coordinator_main
from edge_agent.cli import main as agent_main
from edge_agent.config import AgentConfig
from runtime.example_config import free_tables, keys, render
from tests.example_configs import shipped

KEY = re.compile(r"^(?:#\s*)?([A-Za-z_][A-Za-z0-9_]*)\s*=")
TABLE = re.compile(r"^\[([A-Za-z0-9_.]+)\]")


def listed(text: str, free: set[str]) -> set[str]:
    """The dotted keys an example shows, commented out or not; a free-form table (``free``:
    model.params) counts as one key, whatever samples of it the example shows."""
    found, table = set(), ""
    for line in text.splitlines():
        if header := TABLE.match(line):
            table = header.group(1)
            if table in free:
                found.add(table)
        elif (key := KEY.match(line)) and table not in free:
            found.add(f"{table}.{key.group(1)}" if table else key.group(1))
    return found


@pytest.mark.parametrize(
    ("main", "cls"), [(agent_main, AgentConfig), (coordinator_main, CoordinatorConfig)]
)
def test_example_config_lists_every_key_of_the_dataclasses(main, cls, capsys) -> None:
    assert main(["example-config"]) == 0
    printed = capsys.readouterr().out
    assert listed(printed, set(free_tables(cls))) == set(keys(cls))


def test_the_keys_the_examples_used_to_miss_are_listed(capsys) -> None:
    agent_main(["example-config"])
    agent = capsys.readouterr().out
    assert re.search(r"^max_payload_bytes = 4194304 ", agent, re.M)
    coordinator_main(["example-config"])
    coordinator = capsys.readouterr().out
    assert re.search(r"^online_ttl_s = 3600.0 ", coordinator, re.M)
    assert "\n[workers]" in coordinator and re.search(r"^resend_s = 10.0 ", coordinator, re.M)


@pytest.mark.parametrize("path", list(shipped()), ids=lambda p: p.name)
def test_the_shipped_example_is_what_example_config_prints(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert render(shipped()[path], text) == text, (
        f"{path} differs from its dataclasses: run `python -m tests.example_configs`"
    )


def test_a_key_the_notes_lack_or_misstate_is_still_rendered_with_its_default() -> None:
    path = next(p for p, c in shipped().items() if c is AgentConfig)
    text = path.read_text(encoding="utf-8")
    lacking = "\n".join(
        line for line in text.splitlines() if not line.startswith("max_payload_bytes")
    )
    stale = lacking.replace("keepalive = 30", "keepalive = 99")
    rendered = render(AgentConfig, stale)
    assert "\nmax_payload_bytes = 4194304\n" in rendered  # bare, but there
    assert "\nkeepalive = 30\n" in rendered and "keepalive = 99" not in rendered
