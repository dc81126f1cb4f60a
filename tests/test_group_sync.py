"""Group commit (coordinator/storage/group_sync.py): what waits on it runs only after an
fsync of the write-ahead log that began after it was queued, in order; a failed fsync
holds everything back."""

from __future__ import annotations

import functools
import os
import sqlite3
import threading
from pathlib import Path

import pytest

from coordinator.storage.group_sync import GroupSync


def _wal_db(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE t (x)")
    return db


def test_actions_run_in_order_after_an_fsync_of_the_log(tmp_path: Path, monkeypatch) -> None:
    db = _wal_db(tmp_path / "d.sqlite3")
    events: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    monkeypatch.setattr("coordinator.storage.group_sync.os.fsync", fsync)
    sync = GroupSync(tmp_path / "d.sqlite3", on_error=lambda exc: None)
    try:
        for i in range(3):
            db.execute("INSERT INTO t VALUES (?)", (i,))
            sync.after_sync(functools.partial(events.append, f"receipt {i}"))
        sync.flush()
    finally:
        sync.close()
    receipts = [e for e in events if e.startswith("receipt")]
    assert receipts == ["receipt 0", "receipt 1", "receipt 2"]
    # Every receipt comes after an fsync (the log, and its folder the first time).
    assert events[0] == "fsync"
    assert events.index("receipt 0") > 0
    # Batched: fewer fsyncs of the log than receipts is allowed, never a receipt first.
    assert sync.syncs >= 1


def test_a_failed_fsync_holds_the_receipts_back(tmp_path: Path, monkeypatch) -> None:
    db = _wal_db(tmp_path / "d.sqlite3")  # open: its log stays (closed, SQLite folds it in)
    db.execute("INSERT INTO t VALUES (1)")

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("coordinator.storage.group_sync.os.fsync", broken)
    failed = threading.Event()
    sent: list[int] = []
    sync = GroupSync(tmp_path / "d.sqlite3", on_error=lambda exc: failed.set())
    sync.after_sync(lambda: sent.append(1))
    assert failed.wait(10)
    with pytest.raises(OSError, match="Input/output error"):
        sync.flush()
    sync.close()
    assert sent == []
