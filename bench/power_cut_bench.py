"""Power cuts at full size (issue 53; tests/test_power_cut.py runs them small), on a file
system that loses every write not fsync'd (fleet/powercut/lazyfs.py):

- ``reliability.power_cut_receipted_lost``: receipted updates not in the coordinator's
  database after ``CUTS`` cuts under load (fleet/powercut/coordinator_cuts.py) at the
  default ``sqlite_synchronous`` (GROUP); ``reliability.power_cut_coordinator_cuts``,
  ``..._receipted`` (updates some receipt named) and ``..._damaged`` (cuts after which
  SQLite's integrity check failed) beside it. ``reliability.power_cut_receipted_lost_normal``
  and ``..._receipted_normal``: the same for ``NORMAL_CUTS`` cuts at NORMAL, what GROUP buys.
- ``reliability.power_cut_ledger_lost``: releases that left a dp device and whose spend
  its privacy ledger lacked after one of ``CUTS`` cuts (fleet/powercut/device_cuts.py);
  ``reliability.power_cut_device_cuts``, ``..._releases``, ``..._device_unreadable``
  (cuts after which its ledger or state would not load) and ``..._epsilon_lowered``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from fleet.powercut.coordinator_cuts import coordinator_cuts
from fleet.powercut.device_cuts import device_cuts

CUTS = 50
NORMAL_CUTS = 5


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full = coordinator_cuts(root / "full", cuts=CUTS, seed=1)
        print(f"  coordinator, GROUP (the default): {full}", file=sys.stderr)
        normal = coordinator_cuts(root / "normal", cuts=NORMAL_CUTS, seed=1, synchronous="NORMAL")
        print(f"  coordinator, NORMAL: {normal}", file=sys.stderr)
        bundle = root / "zoo" / "bundle"
        subprocess.run(
            [str(Path(sys.executable).parent / "edge-export"), "zoo", "--out", str(bundle),
             "--size", "small"],
            check=True, capture_output=True,
        )  # fmt: skip
        device = device_cuts(root / "device", bundle, cuts=CUTS, seed=1)
        print(f"  device: {device}", file=sys.stderr)
    return {
        "reliability.power_cut_coordinator_cuts": full.cuts,
        "reliability.power_cut_receipted": full.receipted,
        "reliability.power_cut_receipted_lost": full.lost,
        "reliability.power_cut_damaged": full.damaged,
        "reliability.power_cut_rounds_closed": full.rounds_closed,
        "reliability.power_cut_receipted_normal": normal.receipted,
        "reliability.power_cut_receipted_lost_normal": normal.lost,
        "reliability.power_cut_device_cuts": device.cuts,
        "reliability.power_cut_releases": device.releases,
        "reliability.power_cut_ledger_lost": device.lost,
        "reliability.power_cut_device_unreadable": device.unreadable,
        "reliability.power_cut_epsilon_lowered": device.epsilon_lowered,
    }


if __name__ == "__main__":
    for key, value in sorted(run().items()):
        print(f"{key}  {value:.4g}")
