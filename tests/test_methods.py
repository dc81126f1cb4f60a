"""The method records (protocol/methods.py, edge_agent/methods.py): every registry keyed by
a method covers exactly the recorded methods, and no module outside the two records
compares a method's name as a literal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from coordinator.strategies import available
from edge_agent.inference import RULES
from edge_agent.methods import DEVICE_METHODS, METHODS, device_method
from edge_agent.train import LOSSES
from fleet.engine.losses import GROUP_LOSSES
from protocol.methods import WIRE_METHODS, WireMethod, wire_method

ROOT = Path(__file__).resolve().parent.parent
RECORDS = {ROOT / "protocol" / "methods.py", ROOT / "edge_agent" / "methods.py"}
PACKAGES = ("protocol", "runtime", "export", "edge_agent", "coordinator", "fleet", "bench")


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


def test_no_method_name_is_compared_as_a_literal_outside_the_records():
    names = set(WIRE_METHODS)
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in RECORDS:
                continue
            for line in literal_comparisons(path.read_text(), names):
                found.append(f"{path.relative_to(ROOT)}:{line}")
    assert found == [], "compare against a field of the method's record instead"
