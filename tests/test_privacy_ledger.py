"""The durable privacy ledger: every spend kept across restarts, a changed delta refused,
and replayable noise voiding the guarantee for good."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent.privacy import accounting as acc
from edge_agent.privacy.ledger import Ledger, LedgerError


def test_one_reproducible_spend_voids_the_ledgers_guarantee_for_good(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, epsilon_budget=50.0, delta=1e-5, accountant="rdp")
    ledger.record(0, [acc.release_event(5.0, 5.0)])
    assert ledger.guarantee.startswith("(epsilon, delta)-DP")
    ledger.record(1, [acc.release_event(5.0, 5.0)], reproducible=True)
    ledger.record(2, [acc.release_event(5.0, 5.0)])
    document = json.loads((tmp_path / "privacy.json").read_text())
    assert document["guarantee"] == "none (reproducible noise)"
    assert [s["guarantee"] for s in document["spends"]][1] == "none (reproducible noise)"
    again = Ledger(tmp_path, epsilon_budget=50.0, delta=1e-5, accountant="rdp")
    assert again.guarantee == "none (reproducible noise)"


def test_ledger_is_durable_and_refuses_a_changed_delta(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, epsilon_budget=5.0, delta=1e-5, accountant="rdp")
    first = ledger.record(0, [acc.Event(1.0, 0.1, 10), acc.release_event(5.0, 5.0)])
    second = ledger.record(1, [acc.Event(1.0, 0.1, 10), acc.release_event(5.0, 5.0)])
    assert 0 < first < second
    again = Ledger(tmp_path, epsilon_budget=5.0, delta=1e-5, accountant="rdp")
    assert again.spent() == pytest.approx(second)
    assert json.loads((tmp_path / "privacy.json").read_text())["epsilon_spent"] == pytest.approx(
        second
    )
    with pytest.raises(LedgerError, match="delta"):
        Ledger(tmp_path, epsilon_budget=5.0, delta=1e-6, accountant="rdp")
