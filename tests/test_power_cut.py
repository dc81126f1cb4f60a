"""Power cuts (issue 53) on a file system that loses every write not fsync'd
(fleet/powercut/lazyfs.py): the layer itself, a coordinator cut under load, and a device
cut while it releases. The full-size runs are bench/power_cut_bench.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleet.powercut.coordinator_cuts import coordinator_cuts
from fleet.powercut.device_cuts import device_cuts
from fleet.powercut.mount import LazyMount, available
from runtime.files import atomic_write

pytestmark = pytest.mark.skipif(
    not Path("/dev/fuse").exists(), reason="no /dev/fuse: FUSE is not available here"
)


def test_fuse_is_usable_where_dev_fuse_exists() -> None:
    # Where /dev/fuse exists a missing fusermount3 or libfuse is a setup fault, not a skip.
    assert available() is None


def test_a_cut_loses_exactly_what_was_not_fsynced(tmp_path: Path) -> None:
    with LazyMount(backing=tmp_path / "disk", mountpoint=tmp_path / "mnt") as mount:
        root = tmp_path / "mnt"
        (root / "unsynced").write_bytes(b"written, never fsync'd")
        with (root / "synced").open("wb") as handle:
            handle.write(b"A" * 10_000)
            handle.flush()
            os.fsync(handle.fileno())
            handle.write(b"tail after the fsync")
        # Renamed without an fsync: the name survives, its bytes do not.
        (root / ".tmp").write_bytes(b"new contents")
        (root / ".tmp").replace(root / "renamed")
        atomic_write(root / "atomic", b"durable")
        assert (root / "unsynced").read_bytes() == b"written, never fsync'd"  # before the cut
        mount.cut()
        mount.start()
        assert (root / "unsynced").read_bytes() == b""
        assert (root / "synced").read_bytes() == b"A" * 10_000
        assert (root / "renamed").read_bytes() == b""
        assert (root / "atomic").read_bytes() == b"durable"


@pytest.mark.broker
@pytest.mark.slow  # about 10 s on a quiet machine, a minute on a loaded one
@pytest.mark.parametrize("synchronous", ["GROUP", "FULL"])  # the default, and the other safe one
def test_no_receipted_update_is_lost_to_power_cuts_under_load(
    tmp_path: Path, synchronous: str
) -> None:
    result = coordinator_cuts(tmp_path, cuts=8, seed=53, synchronous=synchronous)
    assert result.receipted > 100 and result.rounds_closed > 10  # under load, rounds closing
    assert result.lost == 0
    assert result.damaged == 0


@pytest.mark.broker
@pytest.mark.slow
def test_at_normal_sync_a_power_cut_loses_receipted_updates(tmp_path: Path) -> None:
    # Why FULL is the default: at NORMAL the write-ahead log is fsync'd only at a
    # checkpoint, and the cut takes every commit since (the receipts went out anyway).
    result = coordinator_cuts(tmp_path, cuts=2, seed=53, synchronous="NORMAL")
    assert result.receipted > 0
    assert result.lost > 0


@pytest.mark.slow
def test_every_release_a_device_made_is_in_its_ledger_after_power_cuts(
    small_zoo: Path, tmp_path: Path
) -> None:
    result = device_cuts(tmp_path, small_zoo, cuts=3, seed=53)
    assert result.releases >= 3
    assert result.lost == 0
    assert result.unreadable == 0
    assert result.epsilon_lowered == 0
