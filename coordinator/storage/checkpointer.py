"""The write-ahead log folded back into the database beside the writer, not inside it.

SQLite's automatic checkpoint runs inside the COMMIT that passes its threshold: the writer
waits while the log is copied into the database and both files are synced. For a batch of
256 FedAvg updates (53 MB) that was 0.47 s of a 0.6 s write (development machine). Here a
thread with a connection of its own runs PASSIVE checkpoints once the writer has committed
about ``every_bytes`` since the last request, until the log is copied back whole, and the
writer goes on meanwhile: a passive checkpoint blocks no writer and no reader, and in WAL
mode a commit is durable in the log whatever the checkpoint's progress, so a crash at any
point loses nothing. The writer keeps SQLite's own checkpoint as a backstop
(``coordinator.storage.schema``), should this thread fall behind a burst of commits.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

#: Passes run back to back while commits keep adding to the log, at most: then the thread
#: waits for the next request, and the writer's backstop bounds the log meanwhile.
MAX_PASSES = 8


class _Worker:
    """The thread's side: its connection, and requests counted under one condition so that
    :meth:`wait_idle` cannot miss one made while a pass ends."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.cond = threading.Condition()
        self.requested = self.done = 0
        self.stopping = False
        self.passes = 0

    def request(self) -> None:
        with self.cond:
            self.requested += 1
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopping or self.requested > self.done)
                    if self.stopping:
                        return
                    target = self.requested
                self._fold()
                with self.cond:
                    self.done = target
                    self.cond.notify_all()
        finally:
            with self.cond:
                self.done = self.requested  # nobody waits on a thread that has ended
                self.cond.notify_all()
            self.db.close()

    def _fold(self) -> None:
        """Passive passes until every frame of the log is in the database (the writer's
        next transaction then starts the log afresh) or commits outpace them."""
        for _ in range(MAX_PASSES):
            try:
                _busy, frames, copied = self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except Exception as exc:  # a full disk, say: the log keeps the data, and the
                # writer meets the fault on its own next write, where it is reported.
                log.warning("write-ahead log checkpoint failed: %s", exc)
                return
            self.passes += 1
            if copied >= frames:
                return


class Checkpointer:
    def __init__(self, path: Path, *, every_bytes: int) -> None:
        self._worker = _Worker(path)
        self._every = every_bytes
        self._written = 0  # bytes committed since the last request (the writer's estimate)
        self._thread = threading.Thread(target=self._worker.run, name="wal-checkpoint",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        # A store dropped without close() (a test's, a crashed caller's) still ends its
        # thread and connection: the thread holds the worker, not this object.
        self._finalizer = weakref.finalize(self, self._worker.stop)

    @property
    def passes(self) -> int:
        """Checkpoint passes run so far (for tests and a curious operator)."""
        return self._worker.passes

    def committed(self, nbytes: int) -> None:
        """The writer committed about ``nbytes``; past the threshold, a checkpoint is asked
        for (one already running takes the new frames on its next pass)."""
        self._written += nbytes
        if self._written >= self._every:
            self._written = 0
            self._worker.request()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once every checkpoint asked for has run; False on timeout."""
        w = self._worker
        with w.cond:
            return w.cond.wait_for(lambda: w.done >= w.requested, timeout)

    def close(self) -> None:
        self._finalizer()
        self._thread.join()
