"""Processes a fleet run starts end when the run's process dies, however it dies.

Ctrl-C and SIGTERM reach ``edge-fleet``'s ``finally`` blocks, which stop the broker, the
coordinator and the workers. SIGKILL (the OOM killer, ``kill -9``) runs no code, so each
child asks the kernel itself for a SIGTERM when its parent goes (Linux
``PR_SET_PDEATHSIG``; the request survives ``exec``). Elsewhere the clean stops remain.

``python -m fleet.transports.tether PARENT_PID COMMAND [ARG...]`` tethers itself, then becomes
COMMAND (for programs that are not ours: Mosquitto, a console script).

The kernel's "parent" is the *thread* that started the child: start tethered processes
from a thread that lives as long as they should (this project starts them from the main
thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def tether(parent: int) -> bool:
    """SIGTERM this process when ``parent`` exits; False if it is gone already."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    # The parent may have died between our fork and the request: then no signal comes.
    return os.getppid() == parent


def command(parent: int, argv: Sequence[str]) -> list[str]:
    """``argv`` run through this module, tethered to ``parent``."""
    return [sys.executable, "-m", "fleet.transports.tether", str(parent), *argv]


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print(
            "usage: python -m fleet.transports.tether PARENT_PID COMMAND [ARG...]", file=sys.stderr
        )
        return 2
    if not tether(int(argv[0])):
        return 1
    os.execvp(argv[1], list(argv[1:]))
    return 127  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
