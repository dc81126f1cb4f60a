import os

# Parallel workers (pytest-xdist, -n auto): each gets its share of the cores for its
# numerical threads. OpenBLAS and torch otherwise start a thread per core in every worker
# and, spinning against each other, made the heaviest linear-algebra tests ten times
# slower. Set before numpy or torch is imported; the processes tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_share))

import fcntl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.transports.broker import MosquittoBroker


@pytest.fixture
def mosquitto() -> Iterator[MosquittoBroker]:
    """A real Mosquitto on a free loopback port, private to one test."""
    with MosquittoBroker() as broker:
        yield broker


@pytest.fixture(scope="session")
def small_zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small zoo bundle, built once per run through the real CLI: parallel workers
    share one (the first to take the lock builds it; the CLI moves it into place whole)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    out = root / "small-zoo" / "bundle"
    with (root / "small-zoo.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            result = subprocess.run(
                [str(Path(sys.executable).parent / "edge-export"), "zoo", "--out", str(out),
                 "--size", "small"],
                capture_output=True,
                text=True,
                timeout=300,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
    return out
