"""Named crash points for durability tests.

``crash_point("after_ledger_write")`` kills the process with SIGKILL when the environment
variable ``PROTOFLEET_CRASH_AT`` names that point, and does nothing otherwise. Tests use it
to stop a real agent between two writes that must survive in order (the privacy ledger
before the update), which no timing-based kill can hit reliably.
"""

from __future__ import annotations

import os
import signal

ENV = "PROTOFLEET_CRASH_AT"


def crash_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
