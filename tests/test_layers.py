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
    "runtime": {"protocol"},
    "export": {"protocol", "runtime"},
    "coordinator": {"protocol", "runtime"},
    "edge_agent": {"protocol", "runtime", "export"},
    "fleet": {"protocol", "runtime", "export", "coordinator", "edge_agent"},
    "bench": {"protocol", "runtime", "export", "coordinator", "edge_agent", "fleet"},
}
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
}


def fleet_rooms_imported(path: Path) -> set[str]:
    """The rooms of fleet/ that ``path`` imports, lazily or not."""
    rooms: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fleet"):
            modules = [node.module]
            if node.module == "fleet":
                modules = [f"fleet.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names if alias.name.startswith("fleet.")]
        rooms.update(m.split(".")[1] for m in modules if m.count(".") >= 1)
    return rooms


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


def test_the_room_reader_sees_absolute_and_package_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from fleet.report import summary\nimport fleet.cli.main\n"
        "def f():\n    from fleet import data\n    from fleet.engine.batch import x\n"
    )
    assert fleet_rooms_imported(sample) == {"report", "cli", "data", "engine"}
