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
    """The small zoo bundle, built once per session through the real CLI."""
    out = tmp_path_factory.mktemp("zoo") / "bundle"
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "edge-export"),
            "zoo",
            "--out",
            str(out),
            "--size",
            "small",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return out
