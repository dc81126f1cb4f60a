"""Process memory readings: the peak a measurement starts from is the process's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from fleet.transports.procmem import peak_self_mb, reset_peak, status_mb


def test_reset_peak_forgets_memory_already_freed() -> None:
    block = np.ones(200 << 17)  # 200 MiB of float64, every page touched
    holding = status_mb(os.getpid(), "VmRSS")
    assert holding >= 200
    del block
    # The kernel folds the live size into the peak lazily: allow it a few pages behind.
    assert peak_self_mb() >= holding - 1
    reset_peak()
    assert peak_self_mb() < holding - 150


def test_a_child_does_not_inherit_its_parents_peak() -> None:
    block = np.ones(200 << 17)
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, fleet.transports.procmem as p; print(json.dumps(p.peak_self_mb()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    del block
    assert 0 < json.loads(child.stdout) < 150


def test_a_gone_process_reads_as_zero() -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert status_mb(int(done.stdout), "VmRSS") == 0.0
