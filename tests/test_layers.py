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
    return names


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_imported_reads_plain_lazy_and_relative_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os.path\nfrom numpy import zeros\n"
        "def f():\n    import torch\n    from . import ids\n"
    )
    assert imported(sample, "protocol") == {"os", "numpy", "torch", "protocol"}


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
