"""How a simulated fleet starts a host process for its agents
(``python -m fleet.transports.worker SPEC.json``): edge-fleet's mqtt transport and the
fault-matrix benchmark start them the same way."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def host_command(spec_file: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a host process for the agents of ``spec_file``.

    One BLAS thread per host, as the host gives torch one: with OpenBLAS's default (a
    thread per core) every agent thread's small matrix product waited in OpenBLAS's
    spinning hand-off, and 300 agents in 3 hosts held the load average over 100 with
    rounds left unanswered (30 agents closed 11 rounds in 70 s, 154 with one thread).
    Read when numpy loads, so it is set for the process."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}  # fmt: skip
    return [sys.executable, "-m", "fleet.transports.worker", str(spec_file)], env
