"""The coordinator store folds its write-ahead log back on the checkpointer's thread."""

from __future__ import annotations

import os
from pathlib import Path

from coordinator.storage.schema import WAL_BACKSTOP_BYTES, WAL_CHECKPOINT_BYTES
from coordinator.storage.store import Store

BATCH_BYTES = 5 << 20  # past the checkpoint size, far below the writer's own backstop


def _wal_bytes(path: Path) -> int:
    return os.path.getsize(f"{path}-wal")


def test_the_log_is_folded_back_after_each_large_commit_so_it_stays_one_batch_long(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "c.db")
    payload = os.urandom(200_000)
    try:
        for r in range(8):
            with store.batch():
                for i in range(BATCH_BYTES // len(payload)):
                    assert store.add_update(r, f"c{i:03d}", payload, received_at=float(r))
            assert store.checkpointer.wait_idle(timeout=30)
        # Unchecked, eight batches would have stacked 40 MB in the log (the writer's own
        # checkpoint waits for 64 MiB); folded back, each batch reuses the same log space.
        assert BATCH_BYTES < _wal_bytes(tmp_path / "c.db") < 2 * BATCH_BYTES
        assert 8 * BATCH_BYTES < WAL_BACKSTOP_BYTES
        assert store.update_clients(7)[:2] == ["c000", "c001"]
        assert store.update_payload(7, "c001") == payload
    finally:
        store.close()


def test_small_commits_are_counted_toward_a_checkpoint(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")
    try:
        # Statuses carry no payload: each commit still counts the pages it appends.
        commits = WAL_CHECKPOINT_BYTES // (2 * 16_384) + 1
        for i in range(commits):
            store.record_status(f"c{i:04d}", state="online", version="1", last_round=None,
                                reason="", at=float(i))  # fmt: skip
        assert store.checkpointer.wait_idle(timeout=30)
        assert store.checkpointer.passes >= 1
    finally:
        store.close()


def test_a_closed_store_leaves_no_log_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    store = Store(path)
    with store.batch():
        store.add_update(0, "a", b"x" * 100_000, received_at=0.0)
    store.close()
    assert not Path(f"{path}-wal").exists()
    again = Store(path)
    try:
        assert again.update_payload(0, "a") == b"x" * 100_000
    finally:
        again.close()


def test_a_log_a_large_batch_grew_is_cut_back_once_it_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    store = Store(path)
    payload = os.urandom(200_000)
    try:
        with store.batch():
            for i in range(100):  # 20 MB in one transaction: the log must hold it whole
                store.add_update(0, f"c{i:03d}", payload, received_at=0.0)
        assert _wal_bytes(path) > 20_000_000
        assert store.checkpointer.wait_idle(timeout=30)
        store.add_update(1, "a", payload, received_at=1.0)  # the log starts afresh here
        assert _wal_bytes(path) <= 2 * WAL_CHECKPOINT_BYTES
    finally:
        store.close()


def test_a_store_dropped_without_close_ends_its_checkpointer(tmp_path: Path) -> None:
    import gc
    import threading

    before = {t for t in threading.enumerate() if t.name == "wal-checkpoint"}
    store = Store(tmp_path / "c.db")
    (mine,) = {t for t in threading.enumerate() if t.name == "wal-checkpoint"} - before
    del store
    gc.collect()
    mine.join(timeout=30)
    assert not mine.is_alive()
