"""docs/architecture.md names files, folders and definitions of the code; every one must
exist, so the page cannot drift from the code unnoticed.

A reference is a backticked path with a slash, to a file or folder of the repository
(`edge_agent/head.py`, `coordinator/`), optionally followed by ``::`` and a name
(`edge_agent/head.py::local_prototypes`, `edge_agent/agent.py::Agent.handle`): the name
must be defined at the top level of that file (a function, class or assignment such as a
registry), or, written ``Class.attr``, in the body of that class. The files are parsed,
never imported. The page's layer table must also match tests/test_layers.py's ALLOWED.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.test_layers import ALLOWED

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"

#: Fewer than this many would mean the parser (or the page) lost its references.
MIN_NAMED = 100
MIN_PATHS = 60

_SPAN = re.compile(r"`([^`\n]+)`")
_REFERENCE = re.compile(
    r"(?P<path>[A-Za-z_][\w.-]*(?:/[\w.-]+)*/?)(?:::(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?))?"
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def references(text: str) -> list[tuple[str, str | None]]:
    """(path, name or None) of every backticked reference in ``text``, in order. A span
    with ``::`` that is not a well-formed reference raises ValueError: a typo in the
    notation must not make a reference silently go unchecked."""
    found: list[tuple[str, str | None]] = []
    for span in _SPAN.findall(text):
        match = _REFERENCE.fullmatch(span)
        if match is None or "/" not in match["path"]:
            # `fleet/transports/runner.py:collect` or `edge_agent/agent.py Agent.x`: a file named with
            # a name the notation does not carry would otherwise go unchecked.
            if "::" in span or re.match(r"[\w/.-]+\.py\W", span):
                raise ValueError(f"malformed reference `{span}`")
            continue
        found.append((match["path"], match["name"]))
    return found


def _assigned(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """What a module or class body defines, by name."""
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        for name in _assigned(node):
            out[name] = node
    return out


@cache
def _module_names(path: Path) -> dict[str, ast.stmt]:
    return _names(ast.parse(path.read_text(), filename=str(path)).body)


def defines(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name`` at its top level, or ``Class.attr`` in a class."""
    head, _, attr = name.partition(".")
    node = _module_names(path).get(head)
    if node is None:
        return False
    if not attr:
        return True
    return isinstance(node, ast.ClassDef) and attr in _names(node.body)


def problems(text: str, root: Path) -> list[str]:
    """Every reference of ``text`` that names a missing file or definition under ``root``."""
    out = []
    for path, name in references(text):
        target = root / path
        if not (target.is_dir() if path.endswith("/") else target.is_file()):
            out.append(f"`{path}` does not exist")
        elif name is not None and (target.suffix != ".py" or not defines(target, name)):
            out.append(f"`{path}::{name}`: {path} defines no {name}")
    return out


def _doc() -> str:
    return DOC.read_text()


def test_references_read_paths_folders_and_names() -> None:
    text = (
        "`coordinator/` and `edge_agent/head.py::local_prototypes`, "
        "`edge_agent/agent.py::Agent.handle`, `r_x`, `(N, K*d_e)`, `.npz`"
    )
    assert references(text) == [
        ("coordinator/", None),
        ("edge_agent/head.py", "local_prototypes"),
        ("edge_agent/agent.py", "Agent.handle"),
    ]


@pytest.mark.parametrize(
    "span",
    [
        "`edge_agent/head.py :: local_prototypes`",
        "`edge_agent/head.py::`",
        "`fleet/transports/runner.py:collect`",
        "`edge_agent/agent.py#Agent.handle`",
        "`edge_agent/agent.py Agent.nothing`",
    ],
)
def test_a_malformed_reference_is_an_error_not_skipped(span: str) -> None:
    with pytest.raises(ValueError, match="malformed"):
        references(f"see {span} there")


def test_wrong_names_and_paths_are_reported(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "REGISTRY: dict[str, int] = {}\nTABLE = {}\n"
        "def build():\n    pass\n"
        "class Thing:\n    size = 1\n    def run(self):\n        pass\n"
    )
    good = (
        "`pkg/` `pkg/mod.py` `pkg/mod.py::REGISTRY` `pkg/mod.py::TABLE` "
        "`pkg/mod.py::build` `pkg/mod.py::Thing` `pkg/mod.py::Thing.run` `pkg/mod.py::Thing.size`"
    )
    assert problems(good, tmp_path) == []
    bad = (
        "`pkg/mod.py::biuld` `pkg/mod.py::Thing.stop` `pkg/mod.py::build.run` "
        "`pkg/other.py` `other/` `pkg/mod.py/`"
    )
    assert len(problems(bad, tmp_path)) == 6


def test_the_page_names_enough_of_the_code() -> None:
    refs = references(_doc())
    named = {(p, n) for p, n in refs if n is not None}
    paths = {p for p, _ in refs}
    assert len(named) >= MIN_NAMED, f"only {len(named)} named definitions"
    assert len(paths) >= MIN_PATHS, f"only {len(paths)} files and folders"


def test_every_named_file_and_definition_exists() -> None:
    assert problems(_doc(), ROOT) == []


def test_every_relative_link_resolves() -> None:
    targets = [t for t in _LINK.findall(_doc()) if "://" not in t and not t.startswith("#")]
    missing = [t for t in targets if not (DOC.parent / t.split("#")[0]).exists()]
    assert targets
    assert missing == []


def test_the_layer_table_is_the_one_the_layer_test_holds() -> None:
    text = _doc()
    section = text.split("## Packages and layers", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        first = re.fullmatch(r"`(\w+)/`", cells[0]) if len(cells) == 3 else None
        if first is None:
            continue
        table[first[1]] = set(re.findall(r"`(\w+)/`", cells[2]))
    assert table == ALLOWED
