"""Group commit for receipts (``sqlite_synchronous = "GROUP"``, issue 53): commits go to
the write-ahead log at SQLite's NORMAL level (written, not fsync'd), and whatever promises
they are durable (a receipt, an announcement of the round they closed) waits here for
one fsync of the log that covers every commit before it. Under load one fsync answers a
whole batch of receipts, where ``FULL`` pays one per update.

Why an fsync of the log file is enough: at NORMAL every commit is ``write()``-n to the
``-wal`` file before SQLite returns, so an fsync of that file afterwards holds it; a
commit already checkpointed out of the log is in the database file, which SQLite fsyncs
at the end of every checkpoint. A log that is new since the last fsync (SQLite made it
afresh) also needs its folder's entry durable, so the folder is fsync'd then.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

Action = Callable[[], object]


class GroupSync:
    """A thread that fsyncs ``database``'s write-ahead log and then runs, in order, the
    actions queued before that fsync began. ``on_error`` gets an fsync's error; the
    actions waiting on it are dropped (their receipts never go out, so devices resend)."""

    def __init__(self, database: Path, *, on_error: Callable[[BaseException], None]) -> None:
        self.wal = database.with_name(database.name + "-wal")
        self.folder = database.parent
        self.on_error = on_error
        self.syncs = 0  # fsyncs made, for the benchmark's and the tests' counts
        self._inode: int | None = None
        self._queue: list[Action] = []
        self._cond = threading.Condition()
        self._requested = 0  # flush() calls waiting for an fsync that began after them
        self._done = 0
        self._stopping = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="group-sync", daemon=True)
        self._thread.start()

    def after_sync(self, action: Action) -> None:
        """Run ``action`` (on this object's thread) once the log is fsync'd past now."""
        with self._cond:
            self._queue.append(action)
            self._cond.notify_all()

    def flush(self, timeout: float = 60.0) -> None:
        """Return once an fsync that began after this call is done and the actions queued
        before it have run; OSError if that fsync failed."""
        with self._cond:
            self._requested += 1
            wanted = self._requested
            self._cond.notify_all()
            if not self._cond.wait_for(
                lambda: self._done >= wanted or self._failed is not None, timeout
            ):
                raise TimeoutError(f"no fsync of {self.wal} in {timeout} s")
            if self._failed is not None:
                raise OSError(f"fsync of {self.wal} failed: {self._failed}") from self._failed

    def close(self) -> None:
        """Run what is queued (after a last fsync) and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._queue or self._requested > self._done or self._stopping
                )
                if self._failed is not None or (
                    self._stopping and not self._queue and self._requested == self._done
                ):
                    return
                actions, self._queue = self._queue, []
                covers = self._requested
            try:
                self._fsync()
            except OSError as exc:
                log.error("fsync of %s failed: receipts held back: %s", self.wal, exc)
                with self._cond:
                    self._failed = exc
                    self._cond.notify_all()
                self.on_error(exc)
                return
            for action in actions:
                action()
            with self._cond:
                self._done = max(self._done, covers)
                self._cond.notify_all()

    def _fsync(self) -> None:
        self.syncs += 1
        try:
            fd = os.open(self.wal, os.O_RDONLY)
        except FileNotFoundError:
            return  # no log: every commit is in the database file, synced at its checkpoint
        try:
            os.fsync(fd)
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        if inode != self._inode:
            folder = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
            self._inode = inode
