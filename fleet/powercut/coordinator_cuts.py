"""Power cuts under a coordinator at work (issue 53): its state directory on a lazy file
system (fleet/powercut/lazyfs.py), stand-in devices answering every round over a real
Mosquitto, and the power cut at seeded random points; after each cut the database must
open clean, and at the end every update a receipt named must be in it.

A cut comes after a random number of receipts since the coordinator's (re)start, so it
lands anywhere in the stream of commits, receipts and round closes. The coordinator is
killed (SIGKILL) and then the file system, as one power cut stops both; the devices and
the broker stand for the rest of the fleet, which keeps its power. The rounds are kept
(``keep_rounds = 0``), so "in a closed round" and "in the database" are one check: the
row of (round, client) with the very bytes the receipt's digest names, in the run the
receipt names.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

from coordinator.service.owner_service import receipt_filter
from fleet.powercut.mount import LazyMount
from fleet.transports.broker import MosquittoBroker
from protocol import PrototypeUpdate, RoundAnnouncement, round_topic, update_topic
from protocol.receipts import Receipt, payload_digest
from protocol.update import PrivacyMeta

FLEET = "cuts"
BUNDLE = "c" * 64
CLASSES, DIM = 4, 16
#: The longest wait for one step of a cut cycle (a start, a count of receipts).
STEP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CutResult:
    cuts: int
    receipted: int  # distinct updates some receipt named
    lost: int  # of those, not in the database after the last restart
    damaged: int  # cuts after which SQLite's integrity check failed
    rounds_closed: int


def update_payload(round_: int, client: str, *, epsilon: float | None = None) -> bytes:
    """The one update ``client`` sends in ``round_`` (the same bytes on every resend).
    ``epsilon``: the total a private device would say it has spent by then (``epsilon``
    a round; None: no formal mechanism)."""
    rng = np.random.default_rng([round_, int(client.rsplit("-", 1)[1])])
    z = rng.normal(size=(CLASSES, DIM))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return PrototypeUpdate(
        fleet=FLEET, round=round_, client=client, bundle=BUNDLE, method="fedproto",
        classes=tuple(range(CLASSES)), counts=tuple(float(c) for c in rng.integers(1, 50, CLASSES)),
        prototypes=z.astype(np.float16), privacy=_privacy(round_, epsilon),
    ).to_wire()  # fmt: skip


def _privacy(round_: int, epsilon: float | None) -> PrivacyMeta:
    if epsilon is None:
        return PrivacyMeta()
    return PrivacyMeta(mechanism="dp", epsilon=epsilon * (round_ + 1), delta=1e-5,
                       guarantee="(epsilon, delta)-DP, add/remove one example")  # fmt: skip


class StandInDevices:
    """``devices`` devices on one MQTT client: each answers every announcement of a round
    it holds no receipt for (a coordinator's restart announces again, so unreceipted
    updates are sent again then), and every receipt is kept. ``epsilon``: what each
    device's update says it spends a round (None: no formal mechanism)."""

    def __init__(
        self, port: int, *, devices: int, first: int = 0, client_id: str = "stand-ins",
        epsilon: float | None = None,
    ) -> None:  # fmt: skip
        self.epsilon = epsilon
        self.clients = [f"dev-{i:03d}" for i in range(first, first + devices)]
        self._mine = set(self.clients)
        self.receipts: dict[tuple[str, int, str], str] = {}  # (run, round, client) -> digest
        self.announcements = 0
        self.latest_round = -1
        self._cond = threading.Condition()
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        self._client.max_inflight_messages_set(1000)
        self._client.on_message = self._on_message
        subscribed = threading.Event()
        self._client.on_subscribe = lambda *_: subscribed.set()
        # On every (re)connect: a clean session forgets its subscriptions with the broker.
        self._client.on_connect = self._on_connect
        self._client.connect("127.0.0.1", port)
        self._client.loop_start()
        if not subscribed.wait(STEP_TIMEOUT_S):
            raise TimeoutError("no SUBACK for the stand-in devices")

    def _on_connect(self, *_: object) -> None:
        self._client.subscribe([(round_topic(FLEET), 1), (receipt_filter(FLEET), 1)])

    def _on_message(self, _c: object, _u: object, message: mqtt.MQTTMessage) -> None:
        if message.topic == round_topic(FLEET):
            heard = RoundAnnouncement.from_wire(message.payload)
            with self._cond:
                self.announcements += 1
                self.latest_round = max(self.latest_round, heard.round)
                due = [c for c in self.clients if (heard.run, heard.round, c) not in self.receipts]
                self._cond.notify_all()
            if heard.params.get("final"):
                return
            for client in due:
                payload = update_payload(heard.round, client, epsilon=self.epsilon)
                self._client.publish(update_topic(FLEET, client), payload, qos=1)
            return
        receipt = Receipt.from_wire(message.payload)
        if receipt.client not in self._mine:
            return  # another stand-in group's (all receipts come on the one filter)
        with self._cond:
            self.receipts[(receipt.run, receipt.round, receipt.client)] = receipt.digest
            self._cond.notify_all()

    def wait(self, what: str, predicate: object) -> None:
        with self._cond:
            if not self._cond.wait_for(predicate, timeout=STEP_TIMEOUT_S):  # type: ignore[arg-type]
                raise TimeoutError(f"no {what} in {STEP_TIMEOUT_S:.0f} s")

    def counts(self) -> tuple[int, int]:
        """(announcements heard, receipts held)."""
        with self._cond:
            return self.announcements, len(self.receipts)

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


def write_config(
    path: Path,
    *,
    state: Path,
    port: int,
    quorum: int,
    synchronous: str = "GROUP",
    extra: str = "",
    timeout_s: float = 600.0,
) -> None:
    """The coordinator's TOML: an insecure fedproto fleet that keeps every round; ``extra``
    is appended (more tables)."""
    path.write_text(
        f'fleet = "{FLEET}"\nstate_dir = "{state}"\nsqlite_synchronous = "{synchronous}"\n'
        f'[model]\nmethod = "fedproto"\nbundle = "{BUNDLE}"\n'
        f"classes = {[str(c) for c in range(CLASSES)]}\ndim = {DIM}\n".replace("'", '"')
        + f"[rounds]\nmin_clients = {quorum}\nwait_after_quorum_s = 0.0\ntimeout_s = {timeout_s}\n"
        "max_rounds = 100000\nkeep_rounds = 0\n"
        f"[mqtt]\nport = {port}\n[security]\ninsecure = true\n" + extra
    )


def start_coordinator(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "edge-coordinator"), "run", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=log.open("ab"),
    )  # fmt: skip


def check_database(db: Path) -> tuple[bool, str | None, dict[tuple[int, str], str]]:
    """(integrity check passed, the run id, digest of every stored update by (round,
    client)), read through the mount as the restarted coordinator reads it."""
    if not db.exists():
        return True, None, {}
    conn = sqlite3.connect(str(db))
    try:
        clean = conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        run = conn.execute("SELECT value FROM meta WHERE key = 'run'").fetchone()
        rows = conn.execute("SELECT round, client, payload FROM updates").fetchall()
    except sqlite3.DatabaseError:
        return False, None, {}
    finally:
        conn.close()
    stored = {(int(r), str(c)): payload_digest(bytes(p)) for r, c, p in rows}
    return clean, None if run is None else str(run[0]), stored


def lost_receipts(
    receipts: dict[tuple[str, int, str], str], run: str | None, stored: dict[tuple[int, str], str]
) -> int:
    """Receipted updates the database does not hold as receipted."""
    return sum(
        key[0] != run or stored.get((key[1], key[2])) != digest for key, digest in receipts.items()
    )


def coordinator_cuts(
    root: Path, *, cuts: int, devices: int = 12, quorum: int = 8, seed: int = 0,
    synchronous: str = "GROUP", max_receipts: int = 60,
) -> CutResult:  # fmt: skip
    """Run a coordinator on a lazy mount under ``root`` and cut its power ``cuts`` times
    (module text); each cut comes after 1..``max_receipts`` receipts since its start."""
    rng = np.random.default_rng(seed)
    state = root / "mnt" / "coordinator"
    config, log = root / "coordinator.toml", root / "coordinator.log"
    damaged = 0
    with MosquittoBroker() as broker, LazyMount(
        backing=root / "disk", mountpoint=root / "mnt"
    ) as mount:  # fmt: skip
        write_config(config, state=state, port=broker.address.port, quorum=quorum,
                     synchronous=synchronous)  # fmt: skip
        devs = StandInDevices(broker.address.port, devices=devices)
        try:
            for _ in range(cuts):
                announced, held = devs.counts()
                proc = start_coordinator(config, log)
                try:
                    devs.wait("announcement after a start",
                              lambda a=announced, p=proc: devs.announcements > a or p.poll() is not None)  # fmt: skip
                    if proc.poll() is not None:
                        raise RuntimeError(f"the coordinator exited: {log.read_text()[-3000:]}")
                    due = held + int(rng.integers(1, max_receipts + 1))
                    devs.wait("receipts", lambda due=due: len(devs.receipts) >= due)
                finally:
                    proc.kill()  # the power cut: the process first, then the disk
                    proc.wait()
                mount.cut()
                mount.start()
                clean, _, _ = check_database(state / "coordinator.sqlite3")
                damaged += not clean
            # The last restart: the coordinator must come up on what the cuts left.
            announced, _ = devs.counts()
            proc = start_coordinator(config, log)
            try:
                devs.wait("announcement after the last start",
                          lambda: devs.announcements > announced or proc.poll() is not None)  # fmt: skip
            finally:
                proc.terminate()
                proc.wait()
            if proc.returncode not in (0, -15):
                raise RuntimeError(f"the coordinator failed: {log.read_text()[-3000:]}")
            receipts = dict(devs.receipts)
            rounds = devs.latest_round
        finally:
            devs.close()
        clean, run, stored = check_database(state / "coordinator.sqlite3")
        damaged += not clean
    return CutResult(
        cuts=cuts, receipted=len(receipts), lost=lost_receipts(receipts, run, stored),
        damaged=damaged, rounds_closed=max(rounds, 0),
    )  # fmt: skip
