"""Restart figures: a real coordinator behind a real Mosquitto with three real agents, whose
database is deleted, or rolled back to an earlier copy, between two lives of the service
(docs/deploy.md, "A lost or rolled-back database").

- ``reliability.db_lost_rounds_to_resume``: rounds the restarted coordinator opens, after
  its database was deleted, up to and including the first that closes (1: its first).
- ``reliability.db_lost_seconds_to_resume``: seconds from that restart to the close.
- ``reliability.db_rolled_back_rounds_to_resume``, ``..._seconds_to_resume``: the same
  after the database was replaced by a copy taken rounds before the devices' last answer.
- ``reliability.db_rolled_back_rounds_behind``: how many rounds behind the devices the
  copy was.

Before runs were bound (protocol version 2) both never resumed: every device answered
``already_answered`` to rounds it had answered in the lost history.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.reliability_bench import _wait, agent_config, small_zoo
from export import bundle as bundle_mod
from fleet.transports.broker import MosquittoBroker

BIN = Path(sys.executable).parent
CLIENTS = 3
#: Rounds the devices answer before the database is lost, and after the copy is taken.
BEFORE, AHEAD = 3, 3
_OPENED = re.compile(r"(?:opened|resuming at|at) round (\d+)")
_CLOSED = re.compile(r"round (\d+) closed with")


class Fleet:
    """The coordinator (restartable) and the agents, logging to files in ``root``."""

    def __init__(self, root: Path, bundle: Path, port: int) -> None:
        self.root, self.lives = root, 0
        bundle_id = bundle_mod.load(bundle).id
        self.config = root / "coordinator.toml"
        self.config.write_text(
            f'fleet = "lab"\nstate_dir = "{root / "state"}"\n[model]\nbundle = "{bundle_id}"\n'
            f"dim = 32\n[rounds]\nmin_clients = {CLIENTS}\nwait_after_quorum_s = 0.0\n"
            f"timeout_s = 120.0\n[mqtt]\nport = {port}\n[security]\ninsecure = true\n"
        )
        self.database = root / "state" / "coordinator.sqlite3"
        self.agent_logs = [root / f"dev-{i}.log" for i in range(CLIENTS)]
        self.agents = []
        for i, domain in enumerate(("clean", "inverted", "colour")):
            cfg = agent_config(root, f"dev-{i}", domain, bundle=bundle, port=port, samples=150,
                               epochs=1)  # fmt: skip
            command = [str(BIN / "edge-agent"), "run", "--config", str(cfg)]
            log = self.agent_logs[i].open("wb")
            self.agents.append(subprocess.Popen(command, stderr=log, stdout=subprocess.DEVNULL))
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.log = root / "coordinator-0.log"

    def start(self) -> float:
        self.log = self.root / f"coordinator-{self.lives}.log"
        self.lives += 1
        self.coordinator = subprocess.Popen(
            [str(BIN / "edge-coordinator"), "run", "--config", str(self.config)],
            stderr=self.log.open("wb"), stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return time.monotonic()

    def stop(self) -> None:
        assert self.coordinator is not None
        self.coordinator.terminate()
        self.coordinator.wait(timeout=60)

    def stored(self, round_: int) -> bool:
        """Every device heard its update of ``round_`` stored."""
        line = f"round {round_}: update stored by the coordinator"
        return all(line in log.read_text() for log in self.agent_logs)

    def resumed(self, started: float) -> tuple[float, float]:
        """(rounds opened by this life up to and including the first to close, seconds
        from ``started`` to that close)."""
        first: list[int] = []

        def closed() -> bool:
            text = self.log.read_text()
            first[:] = [int(m.group(1)) for m in _CLOSED.finditer(text)][:1]
            return bool(first)

        _wait(closed, timeout=300, what="closing round after the restart", every=0.05)
        seconds = time.monotonic() - started
        opened = {int(r) for r in _OPENED.findall(self.log.read_text())}
        return float(len({r for r in opened if r <= first[0]})), seconds

    def close(self) -> None:
        for proc in (*self.agents, self.coordinator):
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in (*self.agents, self.coordinator):
            if proc is not None:
                proc.wait(timeout=60)


def _remove(database: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)


def _latest_round(database: Path, copy_to: Path) -> int:
    live, copy = sqlite3.connect(database), sqlite3.connect(copy_to)
    try:
        live.backup(copy)  # consistent beside the live writer
        return int(copy.execute("SELECT max(round) FROM rounds").fetchone()[0])
    finally:
        live.close()
        copy.close()


def measure(bundle: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, MosquittoBroker() as broker:
        root = Path(tmp)
        fleet = Fleet(root, bundle, broker.address.port)
        try:
            fleet.start()
            _wait(lambda: fleet.stored(BEFORE), timeout=600, what="rounds before", every=0.05)
            fleet.stop()
            _remove(fleet.database)
            rounds, seconds = fleet.resumed(fleet.start())
            out["reliability.db_lost_rounds_to_resume"] = rounds
            out["reliability.db_lost_seconds_to_resume"] = seconds

            backup = root / "backup.sqlite3"
            kept = _latest_round(fleet.database, backup)
            _wait(lambda: fleet.stored(kept + AHEAD), timeout=600, what="rounds ahead", every=0.05)
            fleet.stop()
            _remove(fleet.database)
            shutil.copy(backup, fleet.database)
            rounds, seconds = fleet.resumed(fleet.start())
            out["reliability.db_rolled_back_rounds_to_resume"] = rounds
            out["reliability.db_rolled_back_seconds_to_resume"] = seconds
            out["reliability.db_rolled_back_rounds_behind"] = float(AHEAD)
        finally:
            fleet.close()
    return out


def run() -> dict[str, float]:
    with small_zoo() as bundle:
        return measure(bundle)


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key}: {value:.2f}")
