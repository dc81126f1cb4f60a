"""One running service per state: an advisory lock that the kernel drops with the process.

Two agents on one state folder would both append to its privacy ledger and state.json and
share one MQTT client id, which the broker answers by dropping each in turn; two
coordinators on one database would both run rounds. An operator can start a second copy by
mistake (a unit and a shell, a unit restarted while a stray copy runs): the second is
refused, naming the first. ``flock`` locks vanish when their holder dies, even by SIGKILL,
so a crash leaves no stale lock to clear by hand.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path


class AlreadyRunning(RuntimeError):
    """Another process holds the lock."""


class RunLock:
    """Held from :meth:`take` until :meth:`release` (or the process ends)."""

    def __init__(self, *, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(
        cls,
        path: Path,
        *,
        what: str,
        remedy: str = "stop that one first",
        wait: Callable[[str], None] | None = None,
    ) -> RunLock:
        """Lock ``path`` (created, with its folder). If another process holds it: raise
        :class:`AlreadyRunning`, whose message names ``what`` is locked, the holder's pid
        and the ``remedy``; or, given ``wait``, tell it so and block until the lock is free."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            pid = f" (pid {holder})" if holder.isdigit() else ""
            if wait is None:
                os.close(fd)
                raise AlreadyRunning(
                    f"{what} is in use by another process{pid}; {remedy}"
                ) from None
            wait(f"{what} is in use by another process{pid}; waiting for it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:  # Ctrl-C while waiting
                os.close(fd)
                raise
        # The pid is for the message above only: the lock itself is the flock.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path=path, fd=fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
