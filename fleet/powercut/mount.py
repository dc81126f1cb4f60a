"""A folder on the lazy file system (fleet/powercut/lazyfs.py) that a caller can cut the
power of: ``cut()`` kills the file system's process with SIGKILL, so every write not
fsync'd since is lost, and unmounts; ``start()`` mounts the same backing folder again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

#: How long a mount may take to appear (the daemon imports and starts libfuse).
MOUNT_TIMEOUT_S = 30.0


def available() -> str | None:
    """Why a lazy mount cannot be made here (None when it can)."""
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse"
    if not any(Path(d, "fusermount3").exists() for d in ("/usr/bin", "/bin")):
        return "no fusermount3 (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401  (optional: the dev extra's)
    except (ImportError, OSError) as exc:
        return f"mfusepy cannot load libfuse: {exc}"
    return None


class LazyMount:
    """``mountpoint`` served by a lazy file system over ``backing``; a context manager
    that unmounts on exit."""

    def __init__(self, *, backing: Path, mountpoint: Path, log: Path | None = None) -> None:
        self.backing = backing
        self.mountpoint = mountpoint
        self.log = log or backing.with_name(backing.name + "-lazyfs.log")
        self._proc: subprocess.Popen[bytes] | None = None
        self.cuts = 0

    def start(self) -> None:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fleet.powercut.lazyfs", str(self.backing),
                 str(self.mountpoint)],
                stdout=log, stderr=log,
            )  # fmt: skip
        # Polled: the mount table is the only place a mount's readiness shows, and
        # libfuse offers no event another process can wait on.
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(self.mountpoint):
            if self._proc.poll() is not None:
                raise RuntimeError(f"the lazy file system exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.mountpoint} was not mounted in {MOUNT_TIMEOUT_S} s")
            time.sleep(0.02)

    def cut(self) -> None:
        """Power off: everything not fsync'd is lost. Processes with files open here get
        errors (ENOTCONN) from now on; kill them first, as the power would."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
            self._proc = None
        self.cuts += 1
        self._unmount()

    def _unmount(self) -> None:
        # Lazy (-z): a process that still holds a file here must not keep the mount.
        subprocess.run(
            ["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, check=False
        )

    def stop(self) -> None:
        """Unmount cleanly: nothing is lost (an orderly shutdown flushes, but this file
        system flushes only on fsync, so it is a cut that keeps the cache: kill)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._unmount()

    def __enter__(self) -> LazyMount:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
