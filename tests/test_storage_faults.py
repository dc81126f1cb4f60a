"""A full disk under the coordinator's state directory: a real tmpfs of a few MB mounted
there, a real Mosquitto and the real service. The coordinator stops taking updates, says
why in one line and exits non-zero (systemd restarts it); restarted while the disk is
still full it says so in one line again; once space returns it resumes with nothing lost.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from protocol import PrototypeUpdate
from tests.coordinator_helpers import BUNDLE, coordinator_toml, stand_ins, start
from tests.process_helpers import status

pytestmark = pytest.mark.broker

BIN = Path(sys.executable).parent
CLIENTS = 40
DIM = 256


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs: root in a container that may mount (this project's CI machines)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Write a file until the filesystem has no space left."""
    filler = folder / "filler"
    with filler.open("wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def update(i: int) -> PrototypeUpdate:
    rng = np.random.default_rng(i)
    z = rng.normal(size=(3, DIM))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return PrototypeUpdate(
        fleet="lab",
        round=0,
        client=f"dev-{i}",
        bundle=BUNDLE,
        method="fedpcl",
        classes=(0, 1, 2),
        counts=(5, 6, 7),
        prototypes=z.astype(np.float32),
    )


@pytest.mark.slow
def test_a_full_disk_stops_the_coordinator_in_one_line_and_it_resumes_with_nothing_lost(
    mosquitto, small_disk, tmp_path
):
    config = coordinator_toml(
        tmp_path, mosquitto.address.port, clients=CLIENTS, dim=DIM,
        state_dir=small_disk / "state",
    )  # fmt: skip
    updates = [update(i) for i in range(CLIENTS)]
    with stand_ins(mosquitto) as fleet:
        proc = start(config, log_level="ERROR")
        try:
            fleet.announcement(0)
            filler = fill(small_disk)
            # The broker takes every update (PUBACK); the coordinator cannot store them.
            fleet.send(updates)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 1
        assert "Traceback" not in stderr
        (line,) = stderr.strip().splitlines()
        assert line.startswith("edge-coordinator: error: storage error: database or disk is full")

        # Restarted (as systemd would) while the disk is still full: one line again.
        again = start(config, log_level="ERROR")
        _, stderr = again.communicate(timeout=60)
        assert again.returncode == 1 and "Traceback" not in stderr
        (line,) = stderr.strip().splitlines()
        assert "database or disk is full" in line

        # Space returns: the updates the coordinator never acknowledged come again.
        os.unlink(filler)
        proc = start(config, log_level="ERROR")
        try:
            final = fleet.announcement(1, timeout=60)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 0, stderr
    sent = {u.client for u in updates}
    # The announcement carries a sample of the local sets (the downlink budget) ...
    assert final.local_sets and set(final.local_sets) <= sent
    shown = status("edge-coordinator", config)
    assert shown["rounds_completed"] == 2 and shown["round"]["number"] == 1
    # ... and every update was stored exactly once.
    accepted = {c["client"]: c["updates_accepted"] for c in shown["clients"]}
    assert accepted == dict.fromkeys(sent, 1)
