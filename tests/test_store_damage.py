"""A damaged coordinator database is found at open by SQLite's own check, and said to be
damaged, not mistaken for a passing storage fault (docs/deploy.md, section 4)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.storage.schema import PAGE_SIZE
from coordinator.storage.store import StateError, StorageFault, Store
from coordinator.tier.worker_store import WorkerStore


def filled_store(path):
    store = Store(path)
    for i in range(40):
        store.add_update(0, f"dev-{i}", bytes([i]) * 5000, received_at=1.0)
    store.close()
    with sqlite3.connect(path) as db:  # fold the log into the file, as a clean stop does
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def test_damaged_pages_are_refused_at_open_with_what_to_do(tmp_path):
    path = tmp_path / "coordinator.sqlite3"
    filled_store(path)
    data = bytearray(path.read_bytes())
    pages = len(data) // PAGE_SIZE
    assert pages > 4
    # Garbage over an interior page of the updates table: the header still reads.
    middle = (pages // 2) * PAGE_SIZE
    data[middle : middle + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    before = path.read_bytes()
    with pytest.raises(StateError, match="is damaged") as caught:
        Store(path)
    assert "move it aside" in str(caught.value)
    assert "delivered again" not in str(caught.value)
    assert path.read_bytes() == before  # nothing written to a damaged file


def test_a_sound_database_opens_and_keeps_its_rows(tmp_path):
    path = tmp_path / "coordinator.sqlite3"
    filled_store(path)
    store = Store(path)
    try:
        assert store.add_update(0, "dev-0", b"again", received_at=2.0) is False  # kept
    finally:
        store.close()


def test_a_corruption_met_while_running_is_not_called_a_passing_fault():
    damaged = StorageFault(sqlite3.DatabaseError("database disk image is malformed"))
    assert "damaged" in str(damaged) and "delivered again" not in str(damaged)
    full = StorageFault(sqlite3.OperationalError("database or disk is full"))
    assert "delivered again" in str(full)


def test_a_damaged_worker_database_is_said_so_on_one_line(tmp_path):
    # SQLite's own check reports the damage over several lines; the worker used to pass
    # them on as a "storage error" that a restart would clear.
    path = tmp_path / "worker-w1.sqlite3"
    store = WorkerStore(path)
    for i in range(60):
        store.add(run="r", round_=0, client=f"c{i}", digest="x", payload=bytes([i]) * 5000,
                  now=1.0)  # fmt: skip
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    middle = (len(data) // 4096 // 2) * 4096  # an interior page of the updates table
    data[middle : middle + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    config = tmp_path / "c.toml"
    config.write_text(
        f'fleet = "x"\nstate_dir = "{tmp_path}"\n[model]\nbundle = "{"e" * 64}"\n'
        '[security]\ninsecure = true\n[workers]\nnames = ["w1"]\n'
    )
    worker = subprocess.run(
        [str(Path(sys.executable).parent / "edge-coordinator"), "worker", "--config",
         str(config), "--name", "w1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode != 0
    lines = worker.stderr.strip().splitlines()
    assert len(lines) == 1, worker.stderr
    assert "is damaged" in lines[0] and "move it aside" in lines[0]
    assert "delivered again" not in lines[0]
