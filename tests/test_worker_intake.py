"""Coordinator workers as the signed, durable intake of a sharded coordinator (issue 42),
over a real Mosquitto: signatures checked by whichever worker gets an update, receipts
signed with the coordinator's key after the commit, a resend on a second worker counted
once, and a worker killed mid-round losing nothing and counting nothing twice."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from coordinator.config import load as load_config
from coordinator.decision import Decision
from coordinator.keys import CoordinatorKeys
from coordinator.strategies import make_strategy
from coordinator.tier.intake import Intake
from coordinator.tier.partial import RAW, PartialSum, global_prototypes
from coordinator.tier.partial_wire import (
    CollectRequest,
    PartialMessage,
    collect_topic,
    combine,
    exclusions,
    partial_filter,
)
from coordinator.tier.worker import Worker
from coordinator.tier.worker_store import WorkerStore
from fleet.transports.broker import MosquittoBroker
from protocol import PrototypeUpdate, RoundAnnouncement, round_topic, update_topic
from protocol.auth import Signer, Verifier, sign, signature_problem
from protocol.receipts import Receipt, payload_digest
from protocol.topics import receipt_topic
from runtime import bulkread
from runtime.bulkread import BulkReadClient
from runtime.keyfiles import generate_ed25519, load_signer
from runtime.transport import MqttSettings
from tests.coordinator_helpers import BUNDLE, CLASSES, DIM, coordinator_toml, stand_in_update
from tests.mqtt_helpers import connected
from tests.process_helpers import LoggedProcess

RUN = "run-a"
RECEIPTS = receipt_topic("lab", "x").rsplit("/", 1)[0] + "/+"


@dataclass
class Keys:
    folder: Path  # coordinator.key and devices/, as coordinator_toml wants them
    coordinator: Signer
    devices: dict[str, Signer]

    @property
    def public(self) -> Verifier:
        return self.coordinator.public


def make_keys(tmp_path: Path, clients: int) -> Keys:
    folder = tmp_path / "keys"
    generate_ed25519(folder / "coordinator.key", folder / "coordinator.pub")
    devices = {}
    for i in range(clients):
        generate_ed25519(folder / "private" / f"dev-{i}.key", folder / "devices" / f"dev-{i}.pub")
        devices[f"dev-{i}"] = load_signer(folder / "private" / f"dev-{i}.key")
    return Keys(folder, load_signer(folder / "coordinator.key"), devices)


def signed_announcement(keys: Keys, round_: int) -> bytes:
    unsigned = RoundAnnouncement(
        fleet="lab", round=round_, run=RUN, run_started=1.0, bundle=BUNDLE, method="fedpcl",
        classes=CLASSES, dim=DIM, deadline=2e9,
    )  # fmt: skip
    return sign(unsigned, keys.coordinator, run=RUN).to_wire()


def signed_updates(keys: Keys, count: int, *, round_: int = 1) -> list[PrototypeUpdate]:
    return [
        sign(stand_in_update(i, round_), keys.devices[f"dev-{i}"], run=RUN) for i in range(count)
    ]


class ReceiptBox:
    """The receipts devices get, checked against the coordinator's key as a device does."""

    def __init__(self, coordinator: Verifier) -> None:
        self.coordinator = coordinator
        self.receipts: list[Receipt] = []
        self.bad = 0
        self._cond = threading.Condition()

    def on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        receipt = Receipt.from_wire(message.payload)
        with self._cond:
            if signature_problem(receipt, self.coordinator, run=RUN) is None:
                self.receipts.append(receipt)
            else:
                self.bad += 1
            self._cond.notify_all()

    def clients(self) -> set[str]:
        with self._cond:
            return {r.client for r in self.receipts}

    def wait(self, predicate: object, *, timeout: float = 15.0) -> bool:
        assert callable(predicate)
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.receipts), timeout=timeout)


@contextmanager
def devices(broker: MosquittoBroker, keys: Keys) -> Iterator[tuple[mqtt.Client, ReceiptBox]]:
    """A publisher standing in for the devices, subscribed to every device's receipts."""
    box = ReceiptBox(keys.public)
    with connected(broker.address, "devices", subscribe=(RECEIPTS,)) as (client, _):
        client.on_message = box.on_message
        yield client, box


def publish(client: mqtt.Client, updates: list[PrototypeUpdate]) -> None:
    for u in updates:
        client.publish(update_topic("lab", u.client), u.to_wire(), qos=1).wait_for_publish(10)


class Combiner:
    """The combiner's side of a collect, over the broker: every worker's partial, then the
    workers that share a client asked again without it; the exact merge."""

    def __init__(self, broker: MosquittoBroker) -> None:
        self._stack = ExitStack()
        self.pub, self.inbox = self._stack.enter_context(
            connected(broker.address, "combiner", subscribe=(partial_filter("lab"),))
        )

    def close(self) -> None:
        self._stack.close()

    def ask(self, request: CollectRequest, answers: int) -> list[PartialMessage]:
        seen = len(self.inbox.messages)
        self.pub.publish(collect_topic("lab"), request.to_wire(), qos=1).wait_for_publish(10)
        got = self.inbox.wait(seen + answers, timeout=15)[seen:]
        return [PartialMessage.from_wire(m.payload) for m in got]

    def merge(self, workers: int) -> tuple[PartialSum, list[PartialMessage], dict]:
        first = {
            m.worker: m for m in self.ask(CollectRequest(fleet="lab", run=RUN, round=1), workers)
        }
        assert len(first) == workers
        drop = exclusions(first.values())
        final = dict(first)
        for worker, clients in drop.items():
            request = CollectRequest(fleet="lab", run=RUN, round=1, worker=worker, exclude=clients)
            (answer,) = self.ask(request, 1)
            assert (answer.worker, answer.excluded) == (worker, clients)
            final[worker] = answer
        merged = combine(final.values(), fleet="lab", run=RUN, round_=1)
        return merged, list(first.values()), drop


def assert_equals_one_coordinator(merged: PartialSum, updates: list[PrototypeUpdate]) -> None:
    """Every update once: the clients, and FedPCL's global prototypes to 1e-12 relative
    (RAW: a partial sum is of the rows and counts as sent, docs/scale.md)."""
    assert merged.clients == {u.client for u in updates}
    single = make_strategy("fedpcl", robust=RAW).aggregate(updates, num_classes=3, dim=DIM)
    values, has = global_prototypes(merged)
    assert tuple(int(c) for c in np.flatnonzero(has)) == single.global_classes
    np.testing.assert_allclose(values[has], single.global_prototypes, rtol=1e-12, atol=1e-15)


def in_process_workers(
    stack: ExitStack, broker: MosquittoBroker, keys: Keys, tmp_path: Path, names: list[str]
) -> list[Worker]:
    cfg = load_config(coordinator_toml(tmp_path, broker.address.port, keys=keys.folder))
    settings = MqttSettings(host=broker.address.host, port=broker.address.port)
    workers = []
    for name in names:
        intake = Intake(
            name=name, admission=cfg.admission_checks(), keys=CoordinatorKeys.load(cfg.security),
            store=WorkerStore(tmp_path / f"worker-{name}.sqlite3"),
        )  # fmt: skip
        worker = stack.enter_context(Worker(intake=intake, group="agg", mqtt_settings=settings))
        assert worker.wait_heard(10)
        workers.append(worker)
    return workers


class Handled:
    """Counts the updates a set of workers handled, waits for a number of them."""

    def __init__(self, workers: list[Worker]) -> None:
        self.decisions: list[Decision] = []
        self._cond = threading.Condition()
        for w in workers:
            w._on_update = self

    def __call__(self, decision: Decision) -> None:
        with self._cond:
            self.decisions.append(decision)
            self._cond.notify_all()

    def wait(self, count: int, *, timeout: float = 15.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.decisions) >= count, timeout=timeout):
                raise TimeoutError(f"{len(self.decisions)} of {count} updates handled")


@pytest.mark.broker
@pytest.mark.slow
def test_forged_unsigned_and_foreign_updates_are_refused_by_whichever_worker_gets_them(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path, 12)
    good = signed_updates(keys, 6)
    stranger = load_signer(keys.folder / "private" / "dev-7.key")  # not dev-6's key
    rogue = tmp_path / "rogue.key"
    generate_ed25519(rogue, tmp_path / "rogue.pub")
    refused = {
        "unsigned": stand_in_update(6, 1),
        "bad_signature": sign(stand_in_update(6, 1), stranger, run=RUN),
        "wrong_run": sign(stand_in_update(8, 1), keys.devices["dev-8"], run="run-z"),
        "wrong_round": sign(stand_in_update(9, 2), keys.devices["dev-9"], run=RUN),
        "unenrolled": sign(stand_in_update(20, 1), load_signer(rogue), run=RUN),
    }
    with devices(mosquitto, keys) as (client, box), ExitStack() as stack:
        client.publish(round_topic("lab"), signed_announcement(keys, 1), qos=1, retain=True)
        workers = in_process_workers(stack, mosquitto, keys, tmp_path, ["w1", "w2", "w3"])
        handled = Handled(workers)
        # An announcement of round 5 not signed by the coordinator: not taken.
        forged = RoundAnnouncement.from_wire(signed_announcement(keys, 5))
        forged = sign(forged, load_signer(rogue), run=RUN)
        client.publish(round_topic("lab"), forged.to_wire(), qos=1).wait_for_publish(10)
        for _ in range(3):  # three of each, so each worker very likely refuses some
            publish(client, list(refused.values()))
        publish(client, good)
        handled.wait(3 * len(refused) + len(good))
        assert box.wait(lambda r: sum(not x.refused for x in r) >= len(good))
        totals: dict[str, int] = {}
        for w in workers:
            for reason, n in w.intake.rejected.items():
                totals[reason] = totals.get(reason, 0) + n
        refusers = [w.name for w in workers if set(w.intake.rejected) & set(refused)]
        open_rounds = [w.intake.open_round for w in workers]
    assert totals == {**{reason: 3 for reason in refused}, "foreign_announcement": 3}
    print(f"\nworkers that refused updates: {refusers}")
    assert len(refusers) >= 2
    assert all(o is not None and o.round == 1 for o in open_rounds)
    # Receipts for the stored updates only, each naming the stored payload's digest; the
    # unenrolled device is told so (once a round by each worker that refused it).
    assert box.bad == 0
    stored = [r for r in box.receipts if not r.refused]
    assert {r.client for r in stored} == {u.client for u in good}
    digests = {u.client: payload_digest(u.to_wire()) for u in good}
    assert all(r.digest == digests[r.client] and r.run == RUN for r in stored)
    told = {(r.client, r.refused, r.digest) for r in box.receipts if r.refused}
    assert told == {("dev-20", "unenrolled", payload_digest(refused["unenrolled"].to_wire()))}


@pytest.mark.broker
@pytest.mark.slow
def test_a_resend_landing_on_a_second_worker_is_counted_once_and_receipted(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path, 5)
    updates = signed_updates(keys, 5)
    with devices(mosquitto, keys) as (client, box), ExitStack() as stack:
        client.publish(round_topic("lab"), signed_announcement(keys, 1), qos=1, retain=True)
        workers = in_process_workers(stack, mosquitto, keys, tmp_path, ["w1", "w2"])
        handled = Handled(workers)
        publish(client, updates)
        handled.wait(5)
        # Five, then five again: Mosquitto hands the group's messages out in turn, so
        # each resend reaches the other worker (a device resending before its receipt).
        publish(client, updates)
        handled.wait(10)
        assert box.wait(lambda r: len(r) >= 10)
        combiner = Combiner(mosquitto)
        try:
            merged, first, drop = combiner.merge(2)
        finally:
            combiner.close()
    both = first[0].partial.clients & first[1].partial.clients
    print(f"\nclients stored by both workers: {sorted(both)}")
    assert both, "no resend reached the other worker"
    assert set().union(*drop.values()) == both
    # Equal copies: the worker whose id sorts first keeps them.
    assert list(drop) == ["w2"]
    assert_equals_one_coordinator(merged, updates)
    # Every copy got its receipt, naming the one payload the device sent.
    assert sorted(r.client for r in box.receipts) == sorted(2 * [u.client for u in updates])
    assert {(r.client, r.digest) for r in box.receipts} == {
        (u.client, payload_digest(u.to_wire())) for u in updates
    }


def worker_process(config: Path, name: str) -> LoggedProcess:
    process = LoggedProcess(
        "python", ["-m", "coordinator.tier.worker", "--config", str(config), "--name", name]
    )
    process.wait_for(f"worker {name} ready", timeout=20)
    return process


@pytest.mark.broker
@pytest.mark.slow
def test_a_worker_killed_mid_round_loses_nothing_and_counts_nothing_twice(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path, 30)
    updates = signed_updates(keys, 30)
    config = coordinator_toml(tmp_path, mosquitto.address.port, keys=keys.folder)
    with devices(mosquitto, keys) as (client, box), ExitStack() as stack:
        client.publish(round_topic("lab"), signed_announcement(keys, 1), qos=1, retain=True)
        procs = {name: worker_process(config, name) for name in ("w1", "w2", "w3")}

        def close_all() -> None:  # the restarted w2 too
            for p in procs.values():
                p.close()

        stack.callback(close_all)
        publish(client, updates[:10])
        assert box.wait(lambda r: len({x.client for x in r}) >= 10)
        # kill -9 in the middle of a burst: some of these are in w2's hands, unacknowledged.
        publish(client, updates[10:20])
        procs["w2"].kill()
        publish(client, updates[20:])
        procs["w2"] = worker_process(config, "w2")
        # The devices resend what no receipt names yet, as an agent does every resend_s.
        for _ in range(5):
            if box.wait(lambda r: len({x.client for x in r}) >= 30, timeout=3.0):
                break
            publish(client, [u for u in updates if u.client not in box.clients()])
        assert box.clients() == {u.client for u in updates}
        # Two that have their receipt, sent three times more each: the group hands three
        # messages in a row to three workers, so at least two hold each.
        before = len(box.receipts)
        publish(client, 3 * [updates[0]] + 3 * [updates[1]])
        assert box.wait(lambda r: len(r) >= before + 6)
        combiner = Combiner(mosquitto)
        try:
            merged, first, drop = combiner.merge(3)
        finally:
            combiner.close()
        for p in procs.values():
            assert p.proc.poll() is None, "".join(p.lines[-20:])
    print(
        f"\nstored per worker: {sorted((m.worker, len(m.partial.clients)) for m in first)}; "
        f"left out at the merge: { {w: sorted(c) for w, c in drop.items()} }"
    )
    assert box.bad == 0
    assert {"dev-0", "dev-1"} <= set().union(*drop.values())
    # The updates of the first ten that w2 stored before it was killed were never sent
    # again (their devices had receipts): w2 reports them from its database.
    (w2,) = [m for m in first if m.worker == "w2"]
    assert w2.partial.clients & {u.client for u in updates[2:10]}
    assert_equals_one_coordinator(merged, updates)


@pytest.mark.broker
@pytest.mark.slow
def test_a_queued_burst_read_in_bulk_is_stored_receipted_and_acknowledged_once(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    # The worker reads its socket through runtime/bulkread.py (many MQTT 5 packets a
    # recv(), the acknowledgements of a read sent together): a burst queued for its
    # stopped session arrives back to back, every update is stored and receipted, and
    # every one is acknowledged, so the next start of the session gets none of it again.
    keys = make_keys(tmp_path, 61)
    updates = signed_updates(keys, 61)
    cfg = load_config(coordinator_toml(tmp_path, mosquitto.address.port, keys=keys.folder))
    settings = MqttSettings(host=mosquitto.address.host, port=mosquitto.address.port)
    db = tmp_path / "worker-w1.sqlite3"

    def started(handled: Handled) -> tuple[Worker, WorkerStore]:
        store = WorkerStore(db)
        intake = Intake(
            name="w1", admission=cfg.admission_checks(), keys=CoordinatorKeys.load(cfg.security),
            store=store,
        )  # fmt: skip
        worker = Worker(intake=intake, group="agg", mqtt_settings=settings, on_update=handled)
        return worker.start(), store

    def stopped(worker: Worker, store: WorkerStore) -> None:
        worker.stop()  # the session stays: persistent, a day's expiry
        store.close()

    with devices(mosquitto, keys) as (client, box):
        client.publish(round_topic("lab"), signed_announcement(keys, 1), qos=1, retain=True)
        worker, store = started(Handled([]))
        assert worker.wait_heard(10)
        if bulkread.supported():
            assert isinstance(worker.link.client, BulkReadClient)
        stopped(worker, store)
        publish(client, updates[:60])  # queued for the stopped session
        drained = Handled([])
        worker, store = started(drained)
        drained.wait(60)
        assert box.wait(lambda r: len(r) >= 60)
        stopped(worker, store)
        # Started again: a redelivered update would come ahead of the new one.
        again = Handled([])
        worker, store = started(again)
        publish(client, updates[60:])
        again.wait(1)
        rows = list(store.updates(RUN, 1))
        stopped(worker, store)
    assert [d.reason for d in drained.decisions] == 60 * ["accepted"]
    assert [(d.client, d.reason) for d in again.decisions] == [("dev-60", "accepted")]
    assert box.clients() == {u.client for u in updates}
    assert {r.client: r.digest for r in rows} == {
        u.client: payload_digest(u.to_wire()) for u in updates
    }
