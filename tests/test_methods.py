"""The method records (protocol/methods.py, edge_agent/methods.py): every registry keyed by
a method covers exactly the recorded methods, and no module outside the two records
compares a method's name as a literal."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.strategies import available, make_strategy
from coordinator.strategies.base import RAW
from edge_agent.inference import RULES
from edge_agent.methods import DEVICE_METHODS, METHODS, device_method
from edge_agent.train import LOSSES
from fleet.engine.losses import GROUP_LOSSES
from protocol.methods import WIRE_METHODS, WireMethod, wire_method
from secagg.fleet import SecureAggregation, method_problem

ROOT = Path(__file__).resolve().parent.parent
RECORDS = {ROOT / "protocol" / "methods.py", ROOT / "edge_agent" / "methods.py"}
PACKAGES = (
    "protocol", "closed_form", "runtime", "secagg", "export", "edge_agent", "coordinator", "fleet",
    "bench",
)  # fmt: skip


def test_every_registry_covers_exactly_the_recorded_methods():
    recorded = set(WIRE_METHODS)
    assert set(DEVICE_METHODS) == recorded
    assert set(METHODS) == recorded
    assert set(available()) == recorded  # the coordinator's strategies
    assert set(LOSSES) == {m for m in recorded if device_method(m).trains_head}
    # The vector engine runs a subset: each of them a recorded method that trains a head.
    assert set(GROUP_LOSSES) <= set(LOSSES)
    assert {device_method(m).rule.rule for m in recorded} <= set(RULES)


def test_a_device_record_carries_its_wire_record():
    for name, record in DEVICE_METHODS.items():
        assert record.wire is WIRE_METHODS[name]


def test_an_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown method 'nope'; known: "):
        wire_method("nope")
    with pytest.raises(ValueError, match="'nope' is not supported on the agent"):
        device_method("nope")


def test_a_wire_record_refuses_facts_that_contradict_each_other():
    with pytest.raises(ValueError, match="averaged methods, and only they, send weights"):
        WireMethod("x", extras="weights")
    with pytest.raises(ValueError, match="only a closed-form method sends statistics"):
        WireMethod("x", extras="statistics")
    with pytest.raises(ValueError, match="a second moment belongs to a closed-form method"):
        WireMethod("x", gram=True)
    with pytest.raises(ValueError, match="summed statistics split over workers"):
        WireMethod("x", extras="statistics", closed_form=True)
    with pytest.raises(ValueError, match="does not split"):
        WireMethod("x", extras="weights", averaged=True, splits=True)


def _strings(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def literal_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines where a method name is compared as a literal: ``x == "fedpcl"``,
    ``m in ("fedpcl", "fpl")``, ``match method: case "fedpcl"``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(set(_strings(o)) & names for o in operands):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and set(_strings(node.value)) & names:
            lines.append(node.lineno)
    return lines


def test_the_literal_finder_finds_what_it_is_meant_to():
    names = {"fedpcl", "fpl"}
    src = 'a = m == "fedpcl"\nb = m in ("x", "fpl")\nc = m == "other"\nd = "fedpcl"\n'
    assert literal_comparisons(src, names) == [1, 2]


def _collection_strings(node: ast.expr | None) -> list[str]:
    """The strings a tuple, list or set literal holds, nested ones too. A dict keyed by
    method is a registry, not a list of methods: the coverage test above holds those."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [*_strings(node), *(s for e in node.elts for s in _collection_strings(e))]
    return []


def named_collections(source: str, names: set[str]) -> list[int]:
    """Lines where a module-level name is bound to a collection of method names:
    ``SECURE = ("lda", "ridge")``, ``ALL = {"fpl", "x"}``, ``T = (("solo", 1.0),)``."""
    lines = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and (
            set(_collection_strings(node.value)) & names
        ):
            lines.append(node.lineno)
    return lines


def test_the_collection_finder_finds_what_it_is_meant_to():
    names = {"fedpcl", "lda"}
    src = (
        'A = ("lda", "ridge")\nB: tuple = (("fedpcl", 1),)\nC = {"x"}\nD = ["y", "lda"]\n'
        'def f():\n    E = ("lda",)\nR = {"lda": 1}\n'
    )
    assert named_collections(src, names) == [1, 2, 4]


def found_outside_the_records(finder: Callable[[str, set[str]], list[int]]) -> list[str]:
    """``path:line`` of every place ``finder`` finds a method name, outside the records."""
    names = set(WIRE_METHODS)
    return [
        f"{path.relative_to(ROOT)}:{line}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in RECORDS
        for line in finder(path.read_text(), names)
    ]


def test_no_module_level_collection_lists_methods_outside_the_records():
    found = found_outside_the_records(named_collections)
    assert found == [], "make it a field of the method's record instead"


def test_the_methods_that_split_over_workers_are_those_whose_sums_divide():
    for name, record in WIRE_METHODS.items():
        strategy = make_strategy(name, robust=RAW)
        if record.closed_form:
            assert record.splits and strategy.partial_mean is None
        else:
            assert record.splits == (strategy.partial_mean is not None), name
    assert make_strategy("fedpcl", robust=RAW, weighting="paper").partial_mean == "paper"


def test_the_secure_methods_are_those_the_secure_table_accepts():
    table = SecureAggregation(threshold=2, dataset_size=10, epsilon=0.0)
    for name, record in WIRE_METHODS.items():
        assert (method_problem(table, name) is None) == record.secure, name


def test_no_method_name_is_compared_as_a_literal_outside_the_records():
    found = found_outside_the_records(literal_comparisons)
    assert found == [], "compare against a field of the method's record instead"
