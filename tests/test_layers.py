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
