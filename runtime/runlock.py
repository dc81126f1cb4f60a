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

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def holder(path: Path, *, locks: Path = Path("/proc/locks")) -> int | None:
    """The pid holding ``path``'s lock, or None when nobody does (or this is not Linux).

    Read from the kernel's lock table rather than by trying the lock: a status command
    that held it even for an instant could make a service starting then refuse to run.
    """
    try:
        st = path.stat()
        table = locks.read_text()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234 0 EOF"; a blocked waiter's line
        # starts "1: -> FLOCK ..." and holds nothing.
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
            pid = int(fields[4]) if fields[4].isdigit() else 0
            if pid > 0:
                return pid
            # Held from another pid namespace: the kernel shows no pid; the file says it.
            written = path.read_text(errors="replace").strip()
            return int(written) if written.isdigit() else 0
    return None
