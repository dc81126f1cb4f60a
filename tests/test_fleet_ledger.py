"""The check that a coordinator stored every update of every round exactly once, on
databases written by the real Store (the fleet over Mosquitto is checked in
tests/test_fleet_runs.py)."""

import sqlite3
from pathlib import Path

from coordinator.storage.schema import SCHEMA
from coordinator.storage.store import Commit, Store
from fleet.report.ledger import update_ledger


def _database(path: Path, answers: list[list[str]], *, keep_rounds: int = 0) -> Path:
    """A coordinator database whose round r holds the updates of ``answers[r]``."""
    store = Store(path)
    store.open_first_round(b"a0", opened_at=0.0, deadline=1.0)
    for r, clients in enumerate(answers):
        for client in clients:
            assert store.add_update(r, client, b"u", received_at=float(r))
        store.advance(Commit(r, closed_at=r + 1.0, announcement=b"a", deadline=r + 2.0,
                             keep_rounds=keep_rounds))  # fmt: skip
    store.close()
    return path


def test_every_update_once_is_exact(tmp_path: Path) -> None:
    db = _database(tmp_path / "c.sqlite3", [["a", "b"], ["a", "b"]])
    ledger = update_ledger(db, clients=["a", "b"], rounds=2)
    assert (ledger.expected, ledger.stored, ledger.lost) == (4, 4, 0)
    assert ledger.exact


def test_a_missing_update_is_lost_and_named(tmp_path: Path) -> None:
    db = _database(tmp_path / "c.sqlite3", [["a", "b", "c"], ["a", "c"]])
    ledger = update_ledger(db, clients=["a", "b", "c"], rounds=2)
    assert ledger.lost == 1 and ledger.missing == ((1, "b"),)
    assert not ledger.exact
    # A round the run never reached counts too: every client lacks it.
    assert update_ledger(db, clients=["a", "b", "c"], rounds=3).lost == 4


def test_an_update_from_outside_the_fleet_is_not_counted_as_stored(tmp_path: Path) -> None:
    db = _database(tmp_path / "c.sqlite3", [["a", "x"]])
    ledger = update_ledger(db, clients=["a", "b"], rounds=1)
    assert (ledger.lost, ledger.unexpected) == (1, 1)


def test_a_second_row_for_one_update_is_a_duplicate_not_a_stored_update(tmp_path: Path) -> None:
    # The real schema refuses it; one without the primary key shows the check would see it.
    db = tmp_path / "nokey.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.executescript(SCHEMA.replace(",\n    PRIMARY KEY (round, client)", "", 1))
        conn.execute("INSERT INTO rounds VALUES (0, 0, 1, NULL, X'01', 0)")
        conn.executemany("INSERT INTO updates VALUES (0, ?, 0, X'01')", [("a",), ("a",)])
        conn.execute("INSERT INTO contributions VALUES ('a', 0, 0, 2)")
    ledger = update_ledger(db, clients=["a", "b"], rounds=1)
    assert (ledger.stored, ledger.lost, ledger.duplicates) == (1, 1, 1)


def test_the_real_schema_keeps_one_row_per_update(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    store.open_first_round(b"a0", opened_at=0.0, deadline=1.0)
    assert store.add_update(0, "a", b"u", received_at=0.0)
    assert not store.add_update(0, "a", b"v", received_at=0.5)
    store.close()
    ledger = update_ledger(tmp_path / "c.sqlite3", clients=["a"], rounds=1)
    assert ledger.exact and ledger.tally_gap == 0


def test_rounds_whose_payloads_were_dropped_are_named_not_counted_lost(tmp_path: Path) -> None:
    db = _database(tmp_path / "c.sqlite3", [["a"], ["a"], ["a"]], keep_rounds=1)
    ledger = update_ledger(db, clients=["a"], rounds=3)
    assert ledger.pruned == (0, 1)
    assert (ledger.expected, ledger.lost) == (1, 0)


def test_a_tally_above_the_rows_held_is_a_gap_and_not_exact(tmp_path: Path) -> None:
    # An update counted twice (or quarantined since) leaves the clients' tallies above the
    # rows held, though every expected (round, client) is there.
    db = _database(tmp_path / "c.sqlite3", [["a", "b"]])
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE contributions SET updates = updates + 1 WHERE client = 'a'")
    ledger = update_ledger(db, clients=["a", "b"], rounds=1)
    assert (ledger.lost, ledger.tally_gap) == (0, 1)
    assert not ledger.exact
