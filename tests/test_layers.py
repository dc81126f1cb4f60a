"""The packages' layers, read from their source: protocol/ is the wire contract and needs
nothing beyond the standard library, numpy, msgpack and the signature library; no package
imports one above it (docs/architecture.md)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What each package may import of the project's own packages (itself always).
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "closed_form": set(),
    "runtime": {"protocol"},
    "secagg": {"protocol", "runtime", "closed_form"},
    "export": {"protocol", "runtime", "closed_form"},
    "coordinator": {"protocol", "runtime", "closed_form", "secagg"},
    "edge_agent": {"protocol", "runtime", "closed_form", "secagg", "export"},
    "fleet": {"protocol", "runtime", "closed_form", "secagg", "export", "coordinator", "edge_agent"},
    "bench": {
        "protocol", "runtime", "closed_form", "secagg", "export", "coordinator", "edge_agent",
        "fleet",
    },
}  # fmt: skip
PROTOCOL_THIRD_PARTY = {"numpy", "msgpack", "cryptography"}


def imported(path: Path, package: str) -> set[str]:
    """Top-level names of every module ``path`` imports, lazily or not (relative imports
    count as ``package``, the file's own)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add(package)
            elif node.module:
                names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and _dynamic_import(node.func):
            # importlib.import_module("x.y") / __import__("x"): the named module counts; a
            # name computed at run time cannot be checked, so it counts as itself.
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value.split(".")[0])
            else:
                names.add("<dynamic import>")
    return names


def _dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_imported_reads_plain_lazy_and_relative_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os.path\nfrom numpy import zeros\nimport importlib\n"
        "def f(name):\n    import torch\n    from . import ids\n"
        "    importlib.import_module('paho.mqtt')\n    __import__('onnx')\n"
        "    importlib.import_module(name)\n"
    )
    assert imported(sample, "protocol") == {
        "os",
        "numpy",
        "importlib",
        "torch",
        "protocol",
        "paho",
        "onnx",
        "<dynamic import>",
    }


def test_protocol_is_the_wire_contract_alone() -> None:
    allowed = set(sys.stdlib_module_names) | PROTOCOL_THIRD_PARTY | {"protocol", "__future__"}
    files = sources("protocol")
    assert len(files) >= 10
    beyond = {
        str(path.relative_to(ROOT)): sorted(imported(path, "protocol") - allowed)
        for path in files
        if imported(path, "protocol") - allowed
    }
    assert beyond == {}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_package_imports_one_above_it(package: str) -> None:
    ours = set(ALLOWED)
    above = ours - ALLOWED[package] - {package}
    upward = {
        str(path.relative_to(ROOT)): sorted(imported(path, package) & above)
        for path in sources(package)
        if imported(path, package) & above
    }
    assert upward == {}


#: What the coordinator never imports: it runs on a small server without them (README,
#: docs/architecture.md); a lazy import would still pull them into a deployment's install.
COORDINATOR_NEVER = {"torch", "onnx", "onnxruntime", "opacus", "export", "edge_agent"}


def test_the_coordinator_needs_no_torch_onnx_or_opacus() -> None:
    found = {
        str(path.relative_to(ROOT)): sorted(imported(path, "coordinator") & COORDINATOR_NEVER)
        for path in sources("coordinator")
        if imported(path, "coordinator") & COORDINATOR_NEVER
    }
    assert found == {}


#: fleet/'s rooms and which of the others each may import: data and the batched engine
#: at the bottom, the transports that run a fleet on them, the reports read from a
#: finished run, and the command line over all of it (docs/architecture.md).
FLEET_ROOMS: dict[str, set[str]] = {
    "data": set(),
    "engine": set(),
    "transports": {"data", "engine"},
    "report": {"data", "engine", "transports"},
    "cli": {"data", "engine", "transports", "report"},
    # Power cuts for tests and benchmarks (issue 53): beside the commands, not under them.
    "powercut": {"data", "transports"},
}


def rooms_imported(path: Path, package: str) -> set[str]:
    """The rooms of ``package`` that ``path`` imports, lazily or not."""
    rooms: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            modules = [node.module]
            if node.module == package:
                modules = [f"{package}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names if a.name.startswith(f"{package}.")]
        rooms.update(m.split(".")[1] for m in modules if m.count(".") >= 1)
    return rooms


def fleet_rooms_imported(path: Path) -> set[str]:
    """The rooms of fleet/ that ``path`` imports, lazily or not."""
    return rooms_imported(path, "fleet")


def test_every_fleet_module_lives_in_a_room() -> None:
    loose = sorted(p.name for p in (ROOT / "fleet").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    assert {p.name for p in (ROOT / "fleet").iterdir() if (p / "__init__.py").exists()} == set(
        FLEET_ROOMS
    )


@pytest.mark.parametrize("room", sorted(FLEET_ROOMS))
def test_no_fleet_room_imports_one_above_it(room: str) -> None:
    above = set(FLEET_ROOMS) - FLEET_ROOMS[room] - {room}
    upward = {
        str(path.relative_to(ROOT)): sorted(fleet_rooms_imported(path) & above)
        for path in sorted((ROOT / "fleet" / room).rglob("*.py"))
        if fleet_rooms_imported(path) & above
    }
    assert upward == {}


#: coordinator/'s rooms and which of the others each may import: the strategies and the
#: storage at the bottom, the round cycle over them, the worker tier that runs the cycle
#: over workers, and the services and command over all of it. The modules beside the rooms
#: (configuration, keys, metrics, admission and its statistics checks and [closed_form]
#: settings, the decision, the downlink budget, the
#: aggregation math) are the coordinator's shared vocabulary: every room may import them,
#: and they import no room but the strategies (docs/architecture.md).
COORDINATOR_ROOMS: dict[str, set[str]] = {
    "strategies": set(),
    "storage": set(),
    "rounds": {"strategies", "storage"},
    "tier": {"strategies", "storage", "rounds"},
    "service": {"strategies", "storage", "rounds", "tier"},
}
COORDINATOR_SHARED = {
    "config", "keys", "metrics", "admission", "decision", "downlink", "aggregate",
    "statistics_checks", "closed_form_settings",
}  # fmt: skip


def test_every_coordinator_module_lives_in_a_room_or_is_shared() -> None:
    loose = {p.stem for p in (ROOT / "coordinator").glob("*.py") if p.name != "__init__.py"}
    assert loose == COORDINATOR_SHARED
    rooms = {p.name for p in (ROOT / "coordinator").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(COORDINATOR_ROOMS)


@pytest.mark.parametrize("room", [*sorted(COORDINATOR_ROOMS), "(shared)"])
def test_no_coordinator_room_imports_one_above_it(room: str) -> None:
    if room == "(shared)":
        paths = [ROOT / "coordinator" / f"{name}.py" for name in sorted(COORDINATOR_SHARED)]
        allowed = {"strategies"} | COORDINATOR_SHARED
    else:
        paths = sorted((ROOT / "coordinator" / room).rglob("*.py"))
        allowed = COORDINATOR_ROOMS[room] | COORDINATOR_SHARED | {room}
    upward = {
        str(path.relative_to(ROOT)): sorted(rooms_imported(path, "coordinator") - allowed)
        for path in paths
        if rooms_imported(path, "coordinator") - allowed
    }
    assert upward == {}


def test_the_room_reader_sees_absolute_and_package_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from fleet.report import summary\nimport fleet.cli.main\n"
        "def f():\n    from fleet import data\n    from fleet.engine.batch import x\n"
    )
    assert fleet_rooms_imported(sample) == {"report", "cli", "data", "engine"}


#: The most imports of the project's own modules that may sit inside functions: each one
#: keeps --help or a light install from paying for torch, onnx, matplotlib or an optional
#: extra, and says so in a comment just above it (docs/architecture.md).
MAX_DEFERRED_IMPORTS = 30
OWN = set(ALLOWED) | {"tests"}
LAYERED = [*sorted(ALLOWED), "tests"]


def deferred_imports(path: Path) -> list[int]:
    """Line numbers of the own-module imports inside functions of ``path`` (each once,
    however deeply nested)."""
    lines: set[int] = set()
    for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                modules = ["." if node.level else node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            if any(m == "." or m.split(".")[0] in OWN for m in modules):
                lines.add(node.lineno)
    return sorted(lines)


def _explained(text: list[str], line: int) -> bool:
    """A comment on the import's line or in the lines just above it (blank lines and other
    imports of the same block between them allowed)."""
    if "#" in text[line - 1]:
        return True
    for above in reversed(text[max(0, line - 5) : line - 1]):
        stripped = above.strip()
        if stripped.startswith("#"):
            return True
        if stripped and not stripped.startswith(("import ", "from ")):
            return False
    return False


def test_imports_inside_functions_are_few_and_explained() -> None:
    found = {
        str(path.relative_to(ROOT)): deferred_imports(path)
        for package in LAYERED
        for path in sources(package)
        if deferred_imports(path)
    }
    assert sum(len(lines) for lines in found.values()) <= MAX_DEFERRED_IMPORTS, found
    unexplained = {
        name: [n for n in lines if not _explained((ROOT / name).read_text().splitlines(), n)]
        for name, lines in found.items()
    }
    assert {k: v for k, v in unexplained.items() if v} == {}


def test_the_deferred_import_finder_sees_nested_and_relative_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import numpy\nfrom fleet import x\n"
        "def f():\n    import os\n    # torch: not for --help\n    from edge_agent import train\n"
        "    def g():\n        from . import y\n"
    )
    assert deferred_imports(sample) == [6, 8]
    text = sample.read_text().splitlines()
    assert _explained(text, 6) and not _explained(text, 8)


#: Small modules that each do one thing: the longest a module, and a test file, may be.
MAX_MODULE_LINES, MAX_TEST_LINES = 400, 500


def test_no_module_and_no_test_file_is_longer_than_its_bound() -> None:
    too_long = {}
    for top in sorted(ROOT.iterdir()):
        if not top.is_dir() or top.name.startswith(".") or top.name in {"build", "runs"}:
            continue
        bound = MAX_TEST_LINES if top.name == "tests" else MAX_MODULE_LINES
        for path in sorted(top.rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > bound:
                too_long[str(path.relative_to(ROOT))] = lines
    assert too_long == {}
