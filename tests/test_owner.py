"""The round owner of a sharded coordinator (coordinator/tier/owner.py): its decisions without a
broker (quorum from the workers' receipts, the collect and its exclusions, a worker that
does not answer, a restart), the methods it refuses in one line, and the issue's test: three
worker processes over a real Mosquitto, one killed with SIGKILL in the middle of a round and
restarted, and the round closes with every update exactly once and a single coordinator's
global prototypes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from coordinator.config import CoordinatorConfig, WorkersSettings
from coordinator.config import load as load_config
from coordinator.keys import CoordinatorKeys
from coordinator.service.owner_service import OwnerService, receipt_filter
from coordinator.storage.store import Store
from coordinator.strategies import RobustOptions, make_strategy
from coordinator.strategies.base import RAW
from coordinator.tier.intake import Intake
from coordinator.tier.owner import RoundOwner, refusal
from coordinator.tier.partial_wire import CollectRequest, collect_topic
from coordinator.tier.worker_ledger import worker_summary
from coordinator.tier.worker_store import WorkerStore
from fleet.transports.broker import MosquittoBroker
from protocol import PrototypeUpdate, RoundAnnouncement, round_topic, update_topic
from protocol.auth import Verifier, sign, signature_problem
from protocol.methods import wire_method
from protocol.receipts import Receipt
from runtime.settings import ConfigError
from tests.coordinator_helpers import DIM, config, coordinator_toml, stand_in_update
from tests.mqtt_helpers import connected
from tests.process_helpers import BIN, LoggedProcess
from tests.test_worker_intake import Keys, make_keys

WORKERS = ("w1", "w2", "w3")
SHARDED = f"""
[robust]
median_count_cap = false
median_norm_clip = false
median_direction_screen = false
[workers]
names = {json.dumps(list(WORKERS))}
local_sets = "omit"
collect_retry_s = 1.0
"""


#: A closed-form fleet's: it takes no [robust] table (coordinator/config.py), and no
#: per-client cap over workers (coordinator/tier/owner.py::refusal).
CLOSED_FORM = f"""
[closed_form]
count_cap = 0
[workers]
names = {json.dumps(list(WORKERS))}
collect_retry_s = 1.0
"""


def sharded_toml(
    tmp_path: Path, port: int, keys: Keys, *, clients: int, method: str = "fedpcl", rounds: int = 1
) -> Path:
    """The signed coordinator TOML of the tier (``rounds``: ``max_rounds``, 0 for no end)."""
    path = coordinator_toml(
        tmp_path, port, keys=keys.folder, clients=clients, method=method, rounds=rounds
    )
    closed_form = wire_method(method).closed_form
    path.write_text(path.read_text() + (CLOSED_FORM if closed_form else SHARDED))
    return path


def single_coordinator(updates: list[PrototypeUpdate], method: str = "fedpcl") -> tuple:
    """(classes, rows) of the single coordinator's strategy on the same updates, RAW."""
    result = make_strategy(method, robust=RAW).aggregate(updates, num_classes=3, dim=DIM)
    return result.global_classes, result.global_prototypes


# -- refused in one line ----------------------------------------------------------------------


def sharded(method: str = "fedpcl", **changes: object) -> CoordinatorConfig:
    base = config(Path("/nonexistent"), method=method, feature_dim=8)
    workers = WorkersSettings(count=2, local_sets="omit")
    merged = {"robust": RAW, "workers": workers, **changes}
    return dataclasses.replace(base, **merged)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cfg, setting",
    [
        (sharded("fedavg"), "model.method = 'fedavg'"),
        (sharded("fpl"), "model.method = 'fpl'"),
        (sharded("feddbp"), "model.method = 'feddbp'"),
        (sharded("solo"), "model.method = 'solo'"),
        (sharded(workers=WorkersSettings(count=2)), "local_sets"),
        (
            sharded(
                robust=RobustOptions(
                    median_count_cap=False,
                    median_norm_clip=False,
                    median_direction_screen=False,
                    rule="median",
                )
            ),
            "robust.rule = 'median'",
        ),
        (sharded("fedproto", robust=RobustOptions()), "robust.median_count_cap"),
        (sharded(robust=RobustOptions(**{**RAW.__dict__, "count_cap": 10.0})), "count_cap"),
    ],
)
def test_what_does_not_split_is_refused_in_one_line_naming_the_setting(
    cfg: CoordinatorConfig, setting: str
) -> None:
    why = refusal(cfg)
    assert why is not None and setting in why and "\n" not in why, why
    assert why.startswith("[workers]: ")


@pytest.mark.parametrize("method", ["fedpcl", "fedproto"])
def test_the_sums_methods_run_over_workers_with_raw_options(method: str) -> None:
    assert refusal(sharded(method)) is None


def test_the_refusal_names_every_method_that_runs_over_workers() -> None:
    why = refusal(sharded("fpl"))
    assert why is not None and "supported: fedcof, fedpcl, fedproto, lda, ridge." in why


def test_the_command_refuses_an_unsupported_fleet_before_opening_anything(tmp_path: Path) -> None:
    path = coordinator_toml(tmp_path, 1, method="fedproto")
    path.write_text(path.read_text() + "[workers]\ncount = 2\n")
    result = subprocess.run(
        [str(BIN / "edge-coordinator"), "run", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "robust.median_count_cap" in result.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(
    "table",
    [
        'names = ["w1"]\ncount = 2',
        "count = -1",
        'names = ["w1", "w1"]',
        'names = ["a/b"]',
        "collect_retry_s = 0.0",
        'local_sets = "sample"',
    ],
)
def test_bad_workers_tables_name_the_table(tmp_path: Path, table: str) -> None:
    path = coordinator_toml(tmp_path, 1)
    path.write_text(path.read_text() + f"[workers]\n{table}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.key or "").startswith("workers"), str(info.value)


def test_count_names_the_workers_w1_to_wn() -> None:
    assert WorkersSettings(count=3).members == ("w1", "w2", "w3")
    assert WorkersSettings(names=("a", "b")).members == ("a", "b")
    assert not WorkersSettings().enabled


# -- the owner's decisions, without a broker ----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Tier:
    """An owner and in-memory worker intakes on one signed configuration: what the broker
    would carry, handed over by hand."""

    def __init__(
        self,
        tmp_path: Path,
        keys: Keys,
        *,
        clients: int,
        timeout_s: float = 600.0,
        method: str = "fedpcl",
        rounds: int = 1,
    ):
        path = sharded_toml(tmp_path, 1, keys, clients=clients, method=method, rounds=rounds)
        path.write_text(path.read_text().replace("timeout_s = 600.0", f"timeout_s = {timeout_s}"))
        self.cfg = load_config(path)
        self.clock = Clock()
        self.owner = self.start_owner()
        self.intakes = {
            name: Intake(
                name=name,
                admission=self.cfg.admission_checks(),
                keys=CoordinatorKeys.load(self.cfg.security),
                store=WorkerStore(tmp_path / f"worker-{name}.sqlite3"),
                clock=self.clock,
            )
            for name in WORKERS
        }
        for intake in self.intakes.values():
            assert intake.hear(self.owner.announcement.to_wire()) is None

    def start_owner(self) -> RoundOwner:
        store = Store(self.cfg.database)
        return RoundOwner(config=self.cfg, store=store, clock=self.clock)

    def stop_owner(self) -> None:
        self.owner.close()
        self.owner.store.close()

    def offer(self, worker: str, update: PrototypeUpdate) -> None:
        intake = self.intakes[worker]
        decision = intake.offer(update.to_wire(), topic=update_topic("lab", update.client))
        assert decision.digest is not None, decision
        self.owner.hear_receipt(intake.receipt(decision).to_wire())

    def answer(self, requests: list, workers: tuple[str, ...] = WORKERS) -> None:
        for request in requests:
            assert isinstance(request, CollectRequest)
            for name in workers:
                if request.addressed_to(name):
                    answer = self.intakes[name].collect(
                        run=request.run, round_=request.round, exclude=request.exclude,
                        retract=request.retract,
                    )  # fmt: skip
                    assert self.owner.take_partial(answer.to_wire())


def signed(keys: Keys, run: str, count: int, round_: int = 0) -> list[PrototypeUpdate]:
    return [
        sign(stand_in_update(i, round_), keys.devices[f"dev-{i}"], run=run) for i in range(count)
    ]


def test_quorum_from_receipts_then_collect_exclusions_and_an_exact_close(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, 6)
    tier = Tier(tmp_path, keys, clients=6)
    owner = tier.owner
    updates = signed(keys, owner.run_id, 6)
    for i, u in enumerate(updates[:5]):
        tier.offer(WORKERS[i % 3], u)
    assert owner.poll() == [] and owner.counted == 5  # below the quorum of 6
    tier.offer("w3", updates[5])
    tier.offer("w1", updates[5])  # a resend stored by a second worker: counted once
    assert owner.counted == 6
    (ask_all,) = owner.poll()
    assert ask_all == CollectRequest(fleet="lab", run=owner.run_id, round=0)
    tier.answer([ask_all])
    (ask_again,) = owner.poll()  # dev-5: same bytes on w1 and w3; w1 sorts first and keeps it
    assert isinstance(ask_again, CollectRequest)
    assert (ask_again.worker, ask_again.exclude) == ("w3", frozenset({"dev-5"}))
    tier.answer([ask_again])
    (announcement,) = owner.poll()
    assert isinstance(announcement, RoundAnnouncement) and announcement.round == 1
    closed = owner.closed
    assert closed is not None and closed.merged.clients == {u.client for u in updates}
    classes, rows = single_coordinator(updates)
    assert tuple(np.flatnonzero(closed.has)) == classes
    np.testing.assert_allclose(closed.values[closed.has], rows, rtol=1e-12, atol=1e-15)
    # Announced in f4 (model.announce_dtype), with no local sets ([workers] local_sets).
    np.testing.assert_array_equal(announcement.global_prototypes, rows.astype(np.float32))
    assert announcement.local_sets == {}
    assert signature_problem(announcement, keys.public, run=owner.run_id) is None
    tier.stop_owner()
    shares = {s["worker"]: s for s in worker_summary(tier.cfg.database, WORKERS)}
    assert {w: s["held_last_round"] for w, s in shares.items()} == {"w1": 3, "w2": 2, "w3": 2}
    assert shares["w1"]["share_last_round"] == pytest.approx(3 / 7)


def test_a_silent_worker_is_asked_again_and_the_round_waits_for_it(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, 3)
    tier = Tier(tmp_path, keys, clients=3)
    owner = tier.owner
    updates = signed(keys, owner.run_id, 3)
    for name, u in zip(WORKERS, updates, strict=True):
        tier.offer(name, u)
    (ask_all,) = owner.poll()
    tier.answer([ask_all], workers=("w1", "w3"))  # w2 is down
    assert owner.poll() == []
    tier.clock.now += 1.0  # collect_retry_s
    (ask_w2,) = owner.poll()
    assert ask_w2 == CollectRequest(fleet="lab", run=owner.run_id, round=0, worker="w2")
    tier.answer([ask_w2])
    (announcement,) = owner.poll()
    assert announcement.round == 1 and owner.closed is not None
    assert owner.closed.merged.clients == {u.client for u in updates}


def test_an_owner_restarted_mid_round_collects_at_the_deadline_and_the_partials_decide(
    tmp_path: Path,
) -> None:
    keys = make_keys(tmp_path, 4)
    tier = Tier(tmp_path, keys, clients=4, timeout_s=60.0)
    updates = signed(keys, tier.owner.run_id, 3)
    for name, u in zip(WORKERS, updates, strict=True):
        tier.offer(name, u)
    tier.stop_owner()
    tier.owner = owner = tier.start_owner()  # the receipts heard so far are lost
    assert owner.round == 0 and owner.counted == 0
    assert owner.poll() == []
    tier.clock.now += 60.0  # the deadline, no extension: the count is unknown
    (ask_all,) = owner.poll()
    tier.answer([ask_all])
    (announcement,) = owner.poll()
    assert announcement.round == 1
    assert owner.closed is not None and owner.closed.merged.clients == {"dev-0", "dev-1", "dev-2"}
    tier.stop_owner()


def test_the_deadline_short_of_the_quorum_is_extended_and_re_announced(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, 3)
    tier = Tier(tmp_path, keys, clients=3, timeout_s=60.0)
    owner = tier.owner
    tier.offer("w1", signed(keys, owner.run_id, 1)[0])
    tier.clock.now += 60.0
    (again,) = owner.poll()
    assert isinstance(again, RoundAnnouncement) and again.round == 0
    assert again.deadline == tier.clock.now + 60.0
    tier.stop_owner()


# -- three worker processes, one killed mid-round -------------------------------------------------


class Watch:
    """What devices and an operator see: receipts (checked against the coordinator's key),
    announcements and collect requests; :meth:`wait` blocks on a condition over them."""

    def __init__(self, coordinator: Verifier) -> None:
        self.coordinator = coordinator
        self.run: str | None = None
        self.receipted: set[str] = set()
        self.announced: list[RoundAnnouncement] = []
        self.collects: list[CollectRequest] = []
        self._cond = threading.Condition()

    def on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._cond:
            if message.topic == round_topic("lab"):
                self.announced.append(RoundAnnouncement.from_wire(message.payload))
            elif message.topic == collect_topic("lab"):
                self.collects.append(CollectRequest.from_wire(message.payload))
            else:
                receipt = Receipt.from_wire(message.payload)
                if signature_problem(receipt, self.coordinator, run=self.run) is None:
                    self.receipted.add(receipt.client)
            self._cond.notify_all()

    def wait(self, predicate: Callable[[], bool], *, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout=timeout)


def worker(config: Path, name: str) -> LoggedProcess:
    process = LoggedProcess("edge-coordinator", ["worker", "--config", str(config), "--name", name])
    process.wait_for(f"worker {name} ready", timeout=20)
    return process


@contextmanager
def owner_service(cfg: CoordinatorConfig) -> Iterator[RoundOwner]:
    owner = RoundOwner(config=cfg, store=Store(cfg.database))
    service = OwnerService(owner=owner)
    ready = threading.Event()
    thread = threading.Thread(target=service.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        yield owner
    finally:
        service.stop()
        thread.join(10)
        owner.close()
        owner.store.close()


@pytest.mark.broker
@pytest.mark.slow
def test_three_workers_one_killed_mid_round_every_update_once_and_a_single_coordinators_globals(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path, 20)
    path = sharded_toml(tmp_path, mosquitto.address.port, keys, clients=20)
    cfg = load_config(path)
    watch = Watch(keys.public)
    procs: dict[str, LoggedProcess] = {}
    topics = (receipt_filter("lab"), round_topic("lab"), collect_topic("lab"))
    try:
        with (
            connected(mosquitto.address, "devices", subscribe=topics) as (client, _),
            owner_service(cfg) as owner,
        ):
            client.on_message = watch.on_message
            watch.run = owner.run_id
            updates = signed(keys, owner.run_id, 20)

            def publish(batch: list[PrototypeUpdate]) -> None:
                for u in batch:
                    info = client.publish(update_topic("lab", u.client), u.to_wire(), qos=1)
                    info.wait_for_publish(10)

            for name in WORKERS:
                procs[name] = worker(path, name)
            publish(updates[:8])
            assert watch.wait(lambda: len(watch.receipted) >= 8, timeout=10)
            publish(updates[8:14])
            procs["w2"].kill()  # kill -9 mid-burst: some of these are in w2's hands
            publish(updates[14:])
            # The devices resend what no receipt names yet, as an agent does every resend_s;
            # w1 and w3 take the resends, and the owner reaches its quorum without w2.
            for _ in range(10):
                if watch.wait(lambda: len(watch.receipted) >= 20, timeout=2.0):
                    break
                publish([u for u in updates if u.client not in watch.receipted])
            assert watch.receipted == {u.client for u in updates}
            # The owner collects now, with w2 down: the round waits for it.
            assert watch.wait(lambda: bool(watch.collects), timeout=10), "no collect request"
            assert owner.round == 0 and owner.closed is None
            procs["w2"] = worker(path, "w2")  # answers from its database
            assert watch.wait(lambda: any(a.round == 1 for a in watch.announced), timeout=15)
            closed = owner.closed
            # The first of them: the service says it again as it stops (its last word).
            final = next(a for a in watch.announced if a.round == 1)
    finally:
        for p in procs.values():
            p.close()
    assert closed is not None and closed.merged.clients == {u.client for u in updates}
    classes, rows = single_coordinator(updates)
    assert tuple(np.flatnonzero(closed.has)) == classes
    # The owner's float64 result before the cast, to 1e-12 relative; the announcement
    # carries it cast to model.announce_dtype = "f4".
    np.testing.assert_allclose(closed.values[closed.has], rows, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(final.global_prototypes, rows.astype(np.float32), rtol=1e-6)
    assert final.params["final"] is True
    # edge-coordinator status lists the workers and their share of the intake.
    status = subprocess.run(
        [str(BIN / "edge-coordinator"), "status", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    workers = json.loads(status.stdout)["workers"]
    print(f"\nshares: {[(w['worker'], w['held_last_round']) for w in workers]}; retried: "
          f"{[c.worker for c in watch.collects]}")  # fmt: skip
    assert [w["worker"] for w in workers] == list(WORKERS)
    assert sum(w["held_last_round"] for w in workers) >= 20
    assert all(w["last_round"] == 0 for w in workers)


# -- deployment ----------------------------------------------------------------------------------

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"


def test_the_worker_template_unit_verifies_and_is_installed(tmp_path: Path) -> None:
    text = (SYSTEMD / "edge-coordinator-worker@.service").read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text and "--name %i" in text
    for hardening in ("NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet="):
        assert hardening in text
    dry = subprocess.run(
        [str(SYSTEMD / "install-coordinator.sh"), "--no-deps", "--dry-run"],
        capture_output=True, text=True, timeout=60, env={"PATH": f"{BIN}:/usr/bin:/bin"},
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "edge-coordinator-worker@.service" in dry.stdout
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (CI installs Debian's systemd)")
    # systemd-analyze checks that ExecStart exists: this venv's console script stands in
    # for the installed one. An instance, as systemctl would start it.
    unit = tmp_path / "edge-coordinator-worker@w1.service"
    unit.write_text(
        text.replace("@PREFIX@/venv/bin/", f"{BIN}/").replace("@PREFIX@", "/opt/protofleet")
    )
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr
