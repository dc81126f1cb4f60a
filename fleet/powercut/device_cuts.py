"""Power cuts under a device at work (issue 53): a dp device (DP-SGD every round, each
round a spend in its privacy ledger) whose state directory is on a lazy file system
(fleet/powercut/lazyfs.py), answering rounds back to back (fleet/powercut/device_driver.py);
the power is cut after a seeded random number of releases. After each cut the agent's
state must load, and every release that left the device must be in the ledger: a spend
recorded for its round, and the spent epsilon never below what it was at the release.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleet.data.digits5 import domain_data
from fleet.powercut.mount import LazyMount

#: The most seconds a device may take to start and make one release.
RELEASE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DeviceCutResult:
    cuts: int
    releases: int  # releases that left the device (lines out)
    lost: int  # of those, no spend of their round in the ledger after the cut
    unreadable: int  # cuts after which the ledger or the state would not load
    epsilon_lowered: int  # cuts after which the ledger's spent epsilon went down


def write_agent(root: Path, bundle: Path, state: Path) -> Path:
    """A dp device's configuration (120 digits, a public bound of 120) and its data."""
    root.mkdir(parents=True, exist_ok=True)
    x, y = domain_data("clean", indices=np.arange(120))
    train = root / "train.npz"
    np.savez(train, x=(x * 255).astype(np.uint8), y=y)
    config = root / "agent.toml"
    config.write_text(
        f'agent_id = "dev-cut"\nfleet = "lab"\nstate_dir = "{state}"\nbundle = "{bundle}"\n'
        f'[data]\ntrain = "{train}"\n[train]\nout_dim = 32\nnorm = "group"\nepochs = 1\n'
        '[privacy]\nmechanism = "dp"\nepsilon = 100000.0\nrelease_noise_multiplier = 2.0\n'
        "sgd_noise_multiplier = 1.0\ndataset_size = 120\n[security]\ninsecure = true\n"
    )
    return config


def ledger_rounds(state: Path) -> tuple[list[int], float]:
    """The rounds the ledger has spends for, and its epsilon spent (ValueError if the file
    is not a ledger)."""
    path = state / "privacy.json"
    if not path.exists():
        return [], 0.0
    data = json.loads(path.read_text())
    return [int(s["round"]) for s in data["spends"]], float(data["epsilon_spent"])


def device_cuts(
    root: Path, bundle: Path, *, cuts: int, seed: int = 0, max_releases: int = 3
) -> DeviceCutResult:
    """Cut the power of a releasing device ``cuts`` times (module text)."""
    rng = np.random.default_rng(seed)
    state = root / "mnt" / "state"
    config = write_agent(root / "device", bundle, state)
    log = root / "device.log"
    released: set[int] = set()  # rounds whose release left the device
    missing: set[int] = set()  # of those, rounds a ledger after a cut lacked
    releases = unreadable = lowered = 0
    spent_before = 0.0
    with LazyMount(backing=root / "disk", mountpoint=root / "mnt") as mount:
        for _ in range(cuts):
            proc = subprocess.Popen(
                [sys.executable, "-m", "fleet.powercut.device_driver", str(config)],
                stdout=subprocess.PIPE, stderr=log.open("ab"), text=True,
            )  # fmt: skip
            assert proc.stdout is not None
            try:
                for _ in range(int(rng.integers(1, max_releases + 1))):
                    line = proc.stdout.readline()  # blocks until the next release
                    if not line:
                        raise RuntimeError(f"the device stopped: {log.read_text()[-3000:]}")
                    _, round_, _digest = line.split()
                    released.add(int(round_))
                    releases += 1
            finally:
                proc.kill()  # the power cut: the device first, then its disk
                proc.wait()
            mount.cut()
            mount.start()
            try:
                rounds, spent = ledger_rounds(state)
                json.loads((state / "state.json").read_text())
            except (OSError, ValueError, KeyError) as exc:
                unreadable += 1
                print(f"  unreadable after a cut: {exc}", file=sys.stderr)
                continue
            # Every release so far, not only this cut's: a later cut must not lose either.
            missing |= released - set(rounds)
            lowered += spent < spent_before
            spent_before = max(spent_before, spent)
    return DeviceCutResult(
        cuts=cuts, releases=releases, lost=len(missing), unreadable=unreadable,
        epsilon_lowered=lowered,
    )  # fmt: skip
