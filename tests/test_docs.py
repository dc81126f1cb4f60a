"""The docs do what they say: every command line in a fenced block of README.md and docs/
parses with its command's own parser (a dry run: nothing is executed) and each documented
command prints its help; a figure in prose that cites a results key is that key's value; a
documented default is the code's; the secure-aggregation methods are the code's.

Measured figures belong in generated blocks (bench/figures.py, `make figures`, whose
``--check`` tests/test_bench.py runs); what this file checks is the prose around them."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.figure_results import Results
from coordinator.config import CoordinatorConfig
from coordinator.service.cli import build_parser as coordinator_parser
from edge_agent.cli import build_parser as agent_parser
from edge_agent.config import AgentConfig
from export.cli import build_parser as export_parser
from fleet.cli.main import build_parser as fleet_parser
from protocol.methods import WIRE_METHODS
from runtime.example_config import defaults

SECURE_METHODS = {m.name for m in WIRE_METHODS.values() if m.secure}

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "edge-export": export_parser,
    "edge-agent": agent_parser,
    "edge-coordinator": coordinator_parser,
    "edge-fleet": fleet_parser,
}
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
BLOCK = re.compile(r"<!-- figures:([\w-]+) -->.*?<!-- /figures:\1 -->", re.S)
COMMAND = re.compile(
    r"^(?:\$ |sudo |\S*/bin/)*(?P<script>edge-export|edge-agent|edge-coordinator|edge-fleet)\b"
    r"(?P<rest>.*)$"
)


def documented_commands() -> Iterator[tuple[str, str, list[str]]]:
    """(file, script, argv) of every console-script line in a fenced block."""
    for path in DOCS:
        for block in FENCE.findall(path.read_text()):
            joined = re.sub(r"\\\n\s*", " ", block)  # continued lines
            for line in joined.splitlines():
                found = COMMAND.match(line.strip())
                if not found:
                    continue
                # The command alone: not what a pipe, redirection or comment adds.
                rest = re.split(r"\s(?:\||>|2>|&&|;|#)(?:\s|$)", found["rest"])[0]
                # A shell loop's variable ($n) stands for one of its values: any number.
                rest = re.sub(r"\$\{?\w+\}?", "1", rest)
                yield path.name, found["script"], shlex.split(rest)


def parse(script: str, argv: list[str]) -> str:
    """'' when ``argv`` parses, else the usage error's last line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            PARSERS[script]().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1]
    return ""


def test_every_documented_command_line_parses() -> None:
    commands = list(documented_commands())
    assert len(commands) >= 40  # the walk finds the docs' commands, not nothing
    wrong = [
        f"{name}: {script} {shlex.join(argv)}: {error}"
        for name, script, argv in commands
        if (error := parse(script, argv))
    ]
    assert wrong == []


def test_a_stale_option_in_a_command_block_is_caught() -> None:
    assert "unrecognized arguments: --no-such-option" in parse(
        "edge-fleet", ["compare", "--no-such-option"]
    )


def test_every_documented_command_prints_its_help() -> None:
    subcommands = {(script, argv[0]) for _, script, argv in documented_commands() if argv}
    for script, sub in sorted(subcommands):
        if sub.startswith("-"):
            continue
        out = io.StringIO()
        with pytest.raises(SystemExit) as done, contextlib.redirect_stdout(out):
            PARSERS[script]().parse_args([sub, "--help"])
        assert done.value.code == 0 and f"usage: {script} {sub}" in out.getvalue(), (script, sub)


# -- figures in prose ------------------------------------------------------------------------

#: A number and its unit in prose, a range's two ends too ("42-44 MB").
AMOUNT = re.compile(
    r"(?<![\w.])(?P<low>\d[\d,]*(?:\.\d+)?)(?:\s*-\s*(?P<high>\d[\d,]*(?:\.\d+)?))?"
    r"\s*(?P<unit>MB|kB|GB|ms|s)(?![\w])"
)
#: "`key` = 1.74" or "`key`: 1.74": a figure stated beside its key.
STATED = re.compile(r"`(?P<key>[\w.]+)`\s*[=:]\s*(?P<value>-?\d[\d,]*(?:\.\d+)?)")


def unit_of(key: str) -> str | None:
    """The unit a results key is measured in, read from its name."""
    parts = key.rsplit(".", 1)[-1].split("_")
    if "mb" in parts:
        return "MB"
    if parts[-1] in ("s", "ms") and parts[-2:-1] != ["per"]:
        return parts[-1]
    return None


def shows(shown: str, value: float) -> bool:
    """Whether ``shown`` is ``value`` at the precision it is written with."""
    text = shown.replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return round(value, decimals) == float(text)


def stale_figures(text: str, values: dict[str, float]) -> list[str]:
    """The figures of ``text``'s prose that are not the results keys they cite."""
    prose = FENCE.sub("", BLOCK.sub("", text))
    wrong = []
    for found in STATED.finditer(prose):
        value = values.get(found["key"])
        if value is not None and not shows(found["value"], value):
            wrong.append(f"`{found['key']}` = {found['value']}, measured {value:.4g}")
    for paragraph in re.split(r"\n\s*\n", prose):
        cited = {
            key: value
            for token in re.findall(r"`([\w.*]+)`", paragraph)
            for key, value in values.items()
            if "." in token and fnmatch.fnmatchcase(key, token)
        }
        for unit in {unit_of(key) for key in cited} - {None}:
            measured = [v for k, v in cited.items() if unit_of(k) == unit]
            for amount in AMOUNT.finditer(paragraph):
                if amount["unit"] != unit:
                    continue
                for shown in filter(None, (amount["low"], amount["high"])):
                    if not any(shows(shown, v) for v in measured):
                        wrong.append(f"{amount[0]} beside {sorted(cited)}")
    return wrong


def test_figures_in_prose_are_the_results_they_cite() -> None:
    values = Results.load().values
    wrong = [f"{p.name}: {w}" for p in DOCS for w in stale_figures(p.read_text(), values)]
    assert wrong == []


def test_a_stale_figure_beside_its_key_is_caught() -> None:
    values = {
        "coordinator.db_mb_100_clients_150_rounds_keep_all": 92.389376,
        "coordinator.db_mb_100_clients_150_rounds_keep_25": 18.317312,
        "coordinator.signed_intake_2_over_1": 1.7405,
    }
    # docs/coordinator.md as it stood: figures from an older run under today's keys.
    old = (
        "Kept whole, 100 FedPCL devices add 1.6 MB a round (238 MB after 150 rounds); with "
        "`keep_rounds = 25` the file stays at 42-44 MB from round 50 to round 300 "
        "(`make bench`, `coordinator.db_mb_100_clients_150_rounds_*`)."
    )
    assert stale_figures(old, values) == [
        f"{shown} beside {sorted(k for k in values if 'db_mb' in k)}"
        for shown in ("1.6 MB", "238 MB", "42-44 MB", "42-44 MB")
    ]
    fresh = "Kept whole 92.4 MB, 18.3 MB with 25 (`coordinator.db_mb_100_clients_150_rounds_*`)."
    assert stale_figures(fresh, values) == []
    assert stale_figures("(`coordinator.signed_intake_2_over_1` = 1.61)", values) != []
    assert stale_figures("(`coordinator.signed_intake_2_over_1` = 1.74)", values) == []


# -- documented defaults -----------------------------------------------------------------------

#: "`[rounds] keep_rounds` (default 10)" or "`model.downlink_budget` (default 65,536 bytes".
CONFIG_DEFAULT = re.compile(
    r"`(?:\[(?P<table>[\w.]+)\] |(?P<dotted>[\w]+)\.)?(?P<key>\w+)`\s*\(default:? (?P<value>`[^`]*`|[^)`]*)"
)


def stale_config_defaults(text: str, known: dict[str, object]) -> tuple[int, list[str]]:
    """How many configuration defaults ``text`` states, and those the code does not have."""
    checked, wrong = 0, []
    for found in CONFIG_DEFAULT.finditer(text):
        table = found["table"] or found["dotted"]
        key = f"{table}.{found['key']}" if table else found["key"]
        candidates = [v for k, v in known.items() if k == key or k.endswith(f".{key}")]
        if not candidates:
            continue  # an option of a command, not a configuration key
        checked += 1
        if not any(_default_shown(found["value"], v) for v in candidates):
            wrong.append(f"{found[0]} but the code says {candidates}")
    return checked, wrong


def test_documented_configuration_defaults_are_the_code_defaults() -> None:
    known = {**defaults(AgentConfig), **defaults(CoordinatorConfig)}
    found = [(p.name, stale_config_defaults(p.read_text(), known)) for p in DOCS]
    assert sum(checked for _, (checked, _) in found) >= 5
    assert [f"{name}: {w}" for name, (_, wrong) in found for w in wrong] == []
    assert stale_config_defaults("`[rounds] keep_rounds` (default 25)", known)[1] != []


def _default_shown(shown: str, value: object) -> bool:
    """Whether prose ``shown`` ("65,536 bytes", "20%", "0, 0.3, 1", "clean") is ``value``."""
    items = [item.split()[0] for item in re.split(r",\s+", shown.strip(" ,;"))]
    values = list(value) if isinstance(value, tuple) else [value]
    if len(items) != len(values):
        return False
    return all(_item_shown(item, v) for item, v in zip(items, values, strict=True))


def _item_shown(item: str, value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return item.strip("`\"'") == str(value)
    number = float(item.replace(",", "").rstrip("%"))
    return number == value or (item.endswith("%") and number / 100 == value)


#: "`--domain` (default clean)", "`--alpha`, default 0.5", "`--prefix DIR` (default `/opt`)".
OPTION_DEFAULT = re.compile(
    r"`(?P<option>--[a-z][\w-]*)(?: [A-Z_]+)?`(?:,| \()\s*default:? (?P<value>`[^`]*`|[\w.+-]+)"
)
#: "`--protocol fair` (the default", "`--transport mqtt` (default)".
OPTION_GIVEN = re.compile(
    r"`(?P<option>--[a-z][\w-]*) (?P<value>(?![A-Z_]+`)[\w.-]+)` \((?:the )?default\b"
)


def option_defaults() -> dict[str, list[tuple[object, str]]]:
    """Every option of the four commands' subcommands: [(its default, its help)]."""
    found: dict[str, list[tuple[object, str]]] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            for option in action.option_strings:
                found.setdefault(option, []).append((action.default, action.help or ""))

    for build in PARSERS.values():
        walk(build())
    return found


def _is_default(value: str, default: object, help_text: str) -> bool:
    if value in (str(default), f"`{default}`") or f"(default {value})" in help_text:
        return True
    try:
        return float(value) == float(default)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def stale_option_defaults(text: str, options: dict[str, list[tuple[object, str]]]) -> list[str]:
    """The option defaults ``text`` states that no subcommand has; and how many it states."""
    wrong = []
    for found in [*OPTION_DEFAULT.finditer(text), *OPTION_GIVEN.finditer(text)]:
        if found["option"] not in options:
            continue  # another program's option (make-certs.sh, the installers)
        if not any(_is_default(found["value"], d, h) for d, h in options[found["option"]]):
            wrong.append(found[0])
    return wrong


def test_documented_option_defaults_are_the_commands_defaults() -> None:
    options = option_defaults()
    stated = sum(
        1
        for p in DOCS
        for f in [*OPTION_DEFAULT.finditer(p.read_text()), *OPTION_GIVEN.finditer(p.read_text())]
        if f["option"] in options
    )
    assert stated >= 5  # the docs' statements are found, not none
    wrong = [
        f"{p.name}: {w!r}" for p in DOCS for w in stale_option_defaults(p.read_text(), options)
    ]
    assert wrong == []
    stale = "`--domain` (default inverted) and `--transport vector` (the default)"
    assert len(stale_option_defaults(stale, options)) == 2


# -- FedProto and secure aggregation -----------------------------------------------------------


def test_the_privacy_doc_names_the_methods_secure_aggregation_takes() -> None:
    text = (ROOT / "docs" / "privacy.md").read_text()
    turning_on = re.search(r"\*\*Turning it on\*\* \(([^)]*)\)", text)
    assert turning_on is not None
    named = {m.lower() for m in re.findall(r"\w+", turning_on[1])} - {"and"}
    assert named == set(SECURE_METHODS)
    refusing = re.search(r"Every other method \(([^)]*)\) refuses", text)
    assert refusing is not None
    assert not {m.strip() for m in refusing[1].split(",")} & set(SECURE_METHODS)


def test_a_section_marked_stale_says_so_wherever_it_is_cited() -> None:
    machine = {"cores": 2, "cpu": "AMD EPYC"}
    fresh = {"date": "2026-11-26T06:57:54+00:00", "commit": "119c5fb6def9", "machine": machine}
    r = Results(
        values={},
        section_of={},
        sections={"a": fresh, "b": {**fresh, "stale": "measured before the new projection"}},
    )
    assert r.provenance("a") == "2026-11-26, commit 119c5fb6def9, 2 cores (AMD EPYC)"
    assert r.provenance("b").endswith(", STALE: measured before the new projection")
    assert r.provenance("c") == "not measured"
