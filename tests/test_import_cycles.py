"""No import circle in the tree: two modules that import each other, even only for type
checking, are one module in two files (or a third is missing)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from tests.test_layers import ALLOWED, ROOT

PACKAGES = tuple(ALLOWED)


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports, each by its most specific known name."""
    out: set[str] = set()
    here = module_of(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: Iterable[str] = ()
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != here:
                out.add(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_of_the_tree_import_each_other() -> None:
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    known = {module_of(p) for p in paths}
    # A package's __init__ that re-exports its modules is imported by them only through
    # their own dotted names, which resolve to the modules themselves.
    graph = {module_of(p): imports(p, known) for p in paths}
    for init in [m for m in known if (ROOT / m.replace(".", "/") / "__init__.py").exists()]:
        graph[init] = {m for m in graph[init] if not m.startswith(f"{init}.")}
    assert cycles(graph) == []
