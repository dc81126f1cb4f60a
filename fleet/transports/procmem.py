"""Resident memory of processes, read from /proc (Linux).

The kernel's own peak counter (``VmHWM``) is used rather than ``ru_maxrss``: the latter
survives ``exec``, so a child started from a large process would report its parent's peak.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def status_mb(pid: int, key: str) -> float:
    """One ``kB`` field of /proc/<pid>/status in MiB; 0 when the process or field is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def reset_peak() -> None:
    """Restart this process's peak from its current resident size (``clear_refs`` 5), so a
    measurement is not charged for what an earlier one in the same process held."""
    # On an older or restricted kernel the peak then covers the process's life.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_self_mb() -> float:
    """This process's peak resident memory since start or the last :func:`reset_peak`."""
    return status_mb(os.getpid(), "VmHWM")


class FleetMemory:
    """The peak of the fleet's summed resident memory (broker, coordinator, workers, this
    process), sampled from /proc each time the runner wakes (at least every 2 s)."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.peak_mb = 0.0

    def sample(self) -> None:
        total = status_mb(os.getpid(), "VmRSS")
        total += sum(status_mb(pid, "VmRSS") for pid in self.pids)
        self.peak_mb = max(self.peak_mb, total)
