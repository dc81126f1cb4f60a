"""The closed-form methods over the worker tier (issue 42, item 2): the workers sum the
statistics of the updates they store, the owner adds the sums, takes back the earlier
statistics of a client whose later ones replace them (from whichever worker stored them),
and solves the head with the single coordinator's strategy. Its head equals a single
coordinator's (coordinator/rounds/manager.py) on the same updates to 1e-12 relative: by hand-carried
messages for each case, and over a real Mosquitto with three workers."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

import closed_form as cf
from coordinator.closed_form_settings import ClosedFormSettings
from coordinator.config import load as load_config
from coordinator.keys import CoordinatorKeys
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.stored import RunningStatistics
from coordinator.storage.store import Store
from coordinator.strategies import Aggregate, RobustOptions
from coordinator.tier.intake import Intake
from coordinator.tier.owner import Closed, refusal
from coordinator.tier.partial_wire import CollectRequest, PartialMessage, collect_topic
from coordinator.tier.worker import Worker
from coordinator.tier.worker_store import WorkerStore
from edge_agent.closed_form import StatisticsRelease
from fleet.transports.broker import MosquittoBroker
from protocol import PrototypeUpdate, RoundAnnouncement, round_topic, update_topic
from protocol.auth import sign
from protocol.methods import BIAS
from runtime.transport import MqttSettings
from tests.coordinator_helpers import BUNDLE, DIM, coordinator_toml
from tests.mqtt_helpers import connected
from tests.test_owner import WORKERS, Tier, Watch, owner_service, sharded, sharded_toml
from tests.test_worker_intake import Keys, make_keys

C = 3  # coordinator_toml's classes


def rows(client: int, version: int) -> tuple[np.ndarray, np.ndarray]:
    """Device ``client``'s feature rows (norm <= 1) and labels in data version
    ``version``, of uneven sizes around shared class centres."""
    centres = np.random.default_rng(7).normal(size=(C, DIM))
    rng = np.random.default_rng(100 * client + version)
    n = int(rng.integers(6, 30))
    y = rng.integers(0, C, size=n)
    return cf.clip_rows((centres[y] + rng.normal(size=(n, DIM))) / 3.0), y


def statistics(client: int, round_: int, *, method: str, version: int = 0) -> PrototypeUpdate:
    """Device ``client``'s statistics as an agent sends them (edge_agent/agent.py)."""
    x, y = rows(client, version)
    stats = cf.device_statistics(x, y, C, gram=method != "fedcof")
    return StatisticsRelease.of(stats).update(
        fleet="lab", round_=round_, client=f"dev-{client}", bundle=BUNDLE, method=method
    )


def nothing(client: int, round_: int, *, method: str) -> PrototypeUpdate:
    """The update of a device whose statistics the coordinator holds already."""
    return StatisticsRelease.nothing(DIM).update(
        fleet="lab", round_=round_, client=f"dev-{client}", bundle=BUNDLE, method=method
    )


class Single:
    """The single coordinator on the same updates (unsigned: its own, insecure, run)."""

    def __init__(self, tmp_path: Path, *, method: str, clients: int) -> None:
        (tmp_path / "single").mkdir()
        path = coordinator_toml(tmp_path / "single", 1, method=method, clients=clients, rounds=0)
        # The tier's arithmetic: no per-client cap (coordinator/tier/owner.py::refusal).
        path.write_text(path.read_text() + "[closed_form]\ncount_cap = 0\n")
        self.cfg = load_config(path)
        self.manager = RoundManager(config=self.cfg, store=Store(self.cfg.database),
                                    metrics=Metrics())  # fmt: skip

    def round(self, updates: list[PrototypeUpdate]) -> Aggregate:
        """Offer one round's updates, close it: the solved head, float64."""
        for u in updates:
            decision = self.manager.offer(u.to_wire(), topic_client=u.client)
            assert decision.accepted, decision
        assert self.manager.poll() is not None
        tally = self.manager.tally
        assert isinstance(tally, RunningStatistics) and tally.solved is not None
        return tally.solved

    def close(self) -> None:
        self.manager.store.close()


def assert_same_head(got: Aggregate, want: Aggregate) -> None:
    """Equal heads to 1e-12 relative (of the head's largest value): float64 sums grouped
    otherwise round at other points, by about 1e-16; a lost or doubled client moves the
    head by far more."""
    assert got.global_classes == want.global_classes
    scale = float(np.abs(want.global_prototypes).max())
    np.testing.assert_allclose(got.global_prototypes, want.global_prototypes, rtol=1e-12,
                               atol=1e-12 * scale)  # fmt: skip
    np.testing.assert_allclose(got.extras[BIAS], want.extras[BIAS], rtol=1e-12,
                               atol=1e-12 * scale)  # fmt: skip


def closed_form_tier(tmp_path: Path, keys: Keys, *, method: str, clients: int) -> Tier:
    return Tier(tmp_path, keys, clients=clients, method=method, rounds=0)


def offer(tier: Tier, worker: str, update: PrototypeUpdate, keys: Keys) -> None:
    tier.offer(worker, sign(update, keys.devices[update.client], run=tier.owner.run_id))


def close_round(tier: Tier) -> tuple[RoundAnnouncement, list[CollectRequest], Closed]:
    """Carry the owner's collect requests to the workers until it announces the next
    round, which the workers then hear; the announcement, the requests and the close."""
    asked: list[CollectRequest] = []
    for _ in range(5):  # the first answers, then at most two rounds of asks
        out = tier.owner.poll()
        announcements = [m for m in out if isinstance(m, RoundAnnouncement)]
        if announcements:
            for intake in tier.intakes.values():
                assert intake.hear(announcements[0].to_wire()) is None
            closed = tier.owner.closed
            assert closed is not None and closed.round == announcements[0].round - 1
            return announcements[0], asked, closed
        requests = [m for m in out if isinstance(m, CollectRequest)]
        assert requests, "the owner waits for nothing"
        asked += requests
        tier.answer(requests)
    raise AssertionError(f"no announcement after {asked}")


def later_asks(asked: list[CollectRequest]) -> dict[str, tuple[set[str], dict[str, int]]]:
    """The second phase's requests: worker -> (excluded, retracted)."""
    return {r.worker: (set(r.exclude), dict(r.retract)) for r in asked if r.worker is not None}


# -- the owner's decisions, messages carried by hand -------------------------------------------


@pytest.mark.parametrize("method", ["lda", "ridge", "fedcof"])
def test_statistics_split_over_workers_replaced_across_workers_equal_one_coordinator(
    tmp_path: Path, method: str
) -> None:
    keys = make_keys(tmp_path, 6)
    tier = closed_form_tier(tmp_path, keys, method=method, clients=6)
    single = Single(tmp_path, method=method, clients=6)
    # Round 0: every device's statistics, over three workers; dev-5's resent to a second.
    first = [statistics(i, 0, method=method) for i in range(6)]
    for i, u in enumerate(first):
        offer(tier, WORKERS[i % 3], u, keys)
    offer(tier, "w1", first[5], keys)  # w3 holds it too; the same bytes: w1 keeps it
    announced, asked, closed = close_round(tier)
    assert later_asks(asked) == {"w3": ({"dev-5"}, {})}
    assert_same_head(closed.result, single.round(first))
    assert announced.extras[BIAS].shape == (C,)
    # Round 1: dev-0 (its statistics on w1) has a second data version, taken by w3; the
    # owner asks w1 for the first back. dev-4's second version lands on w2, which has its
    # first: taken back from w2 itself. The others have nothing new.
    second = [nothing(i, 1, method=method) for i in range(6)]
    second[0] = statistics(0, 1, method=method, version=1)
    second[4] = statistics(4, 1, method=method, version=1)
    for u, worker in zip(second, ("w3", "w1", "w2", "w3", "w2", "w1"), strict=True):
        offer(tier, worker, u, keys)
    _, asked, closed = close_round(tier)
    assert later_asks(asked) == {"w1": (set(), {"dev-0": 0}), "w2": (set(), {"dev-4": 0})}
    assert_same_head(closed.result, single.round(second))
    replaced = closed.result
    # Round 2: nothing new anywhere: the same head again, not solved anew.
    third = [nothing(i, 2, method=method) for i in range(6)]
    for i, u in enumerate(third):
        offer(tier, WORKERS[i % 3], u, keys)
    announced, asked, closed = close_round(tier)
    assert later_asks(asked) == {}
    assert closed.result is replaced
    np.testing.assert_array_equal(
        announced.global_prototypes, replaced.global_prototypes.astype(np.float32)
    )
    single.round(third)
    # A restarted owner reads the total and where each client's statistics are from its
    # database: dev-0's third version on w1 takes back the second, from w3.
    tier.stop_owner()
    tier.owner = tier.start_owner()
    fourth = [nothing(i, 3, method=method) for i in range(6)]
    fourth[0] = statistics(0, 3, method=method, version=2)
    for i, u in enumerate(fourth):
        offer(tier, WORKERS[i % 3], u, keys)
    _, asked, closed = close_round(tier)
    assert later_asks(asked) == {"w3": (set(), {"dev-0": 1})}
    assert_same_head(closed.result, single.round(fourth))
    tier.stop_owner()
    single.close()


def test_a_close_that_did_not_commit_is_collected_again_from_the_last_committed_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = make_keys(tmp_path, 3)
    tier = closed_form_tier(tmp_path, keys, method="lda", clients=3)
    single = Single(tmp_path, method="lda", clients=3)
    first = [statistics(i, 0, method="lda") for i in range(3)]
    for i, u in enumerate(first):
        offer(tier, WORKERS[i], u, keys)
    close_round(tier)
    single.round(first)
    second = [statistics(0, 1, method="lda", version=1), nothing(1, 1, method="lda"),
              statistics(2, 1, method="lda", version=1)]  # fmt: skip
    for i, u in enumerate(second):
        offer(tier, WORKERS[(i + 1) % 3], u, keys)

    def full_disk(*args: object, **kw: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    # The statistics of round 1 are written, then the store fails to commit its close.
    monkeypatch.setattr(tier.owner.store, "advance", full_disk)
    with pytest.raises(sqlite3.OperationalError):
        close_round(tier)
    tier.stop_owner()
    monkeypatch.undo()
    tier.owner = tier.start_owner()  # round 1 is open again, its count unknown
    assert tier.owner.round == 1
    tier.clock.now += 600.0  # the deadline: a restarted owner collects what it has
    _, _, closed = close_round(tier)
    assert closed.round == 1
    assert_same_head(closed.result, single.round(second))
    tier.stop_owner()
    single.close()


def test_statistics_whose_earlier_copy_is_gone_stay_and_the_new_ones_are_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(tmp_path, 3)
    tier = closed_form_tier(tmp_path, keys, method="lda", clients=3)
    first = [statistics(i, 0, method="lda") for i in range(3)]
    for i, u in enumerate(first):
        offer(tier, WORKERS[i], u, keys)
    before = close_round(tier)[2].result
    # w3's database lost dev-2's round-0 copy (restored from an older backup, say).
    with sqlite3.connect(tmp_path / "worker-w3.sqlite3") as db:
        db.execute("DELETE FROM updates WHERE client = 'dev-2'")
    second = [nothing(0, 1, method="lda"), nothing(1, 1, method="lda"),
              statistics(2, 1, method="lda", version=1)]  # fmt: skip
    for i, u in enumerate(second):
        offer(tier, WORKERS[i], u, keys)
    with caplog.at_level(logging.ERROR, logger="coordinator.tier.owner_statistics"):
        _, asked, closed = close_round(tier)
    assert "worker w3 no longer holds its statistics of round 0" in caplog.text
    # Asked back from w3, not found there: dev-2's new statistics (on w3) are left out.
    assert later_asks(asked) == {"w3": ({"dev-2"}, {"dev-2": 0})}
    assert "dev-2" not in closed.merged.clients
    assert_same_head(closed.result, before)
    assert closed.statistics is not None and closed.statistics.devices == 3
    tier.stop_owner()


def test_malformed_and_foreign_partials_are_refused_and_counted(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, 2)
    tier = closed_form_tier(tmp_path, keys, method="lda", clients=2)
    for i in range(2):
        offer(tier, WORKERS[i], statistics(i, 0, method="lda"), keys)
    (ask_all,) = tier.owner.poll()
    assert isinstance(ask_all, CollectRequest)
    good = tier.intakes["w1"].collect(run=ask_all.run, round_=0)
    assert good.statistics is not None and good.statistics.clients == {"dev-0"}
    owner = tier.owner
    assert not owner.take_partial(b"\x81\xa1v\x02")  # a map, but no partial of version 3
    assert not owner.take_partial(good.to_wire()[:-5])
    # A worker on a prototype method's configuration: no statistics in its partial.
    prototypes = PartialMessage(
        fleet="lab", run=good.run, round=0, worker="w1", partial=good.partial,
        copies=good.copies,
    )  # fmt: skip
    assert not owner.take_partial(prototypes.to_wire())
    assert owner.refused == {"malformed": 2, "wrong_shape": 1}
    assert owner.take_partial(good.to_wire())
    tier.stop_owner()


def test_the_workers_partial_carries_the_sum_of_its_statistics(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, 3)
    tier = closed_form_tier(tmp_path, keys, method="lda", clients=3)
    updates = [statistics(i, 0, method="lda") for i in range(3)]
    for u in updates:
        offer(tier, "w2", u, keys)
    answer = tier.intakes["w2"].collect(run=tier.owner.run_id, round_=0, exclude={"dev-1"})
    back = PartialMessage.from_wire(answer.to_wire())
    assert back.statistics is not None and back.statistics.clients == {"dev-0", "dev-2"}
    want = cf.merge(cf.device_statistics(*rows(i, 0), C) for i in (0, 2))
    got = back.statistics.stats
    assert got.devices == 2
    np.testing.assert_array_equal(got.counts, want.counts)  # whole numbers: exact
    np.testing.assert_allclose(got.sums, want.sums, rtol=1e-12)
    assert got.gram is not None and want.gram is not None
    np.testing.assert_allclose(got.gram, want.gram, rtol=1e-12)
    tier.stop_owner()


# -- three workers over a real Mosquitto -------------------------------------------------------


@pytest.mark.broker
@pytest.mark.slow
def test_three_workers_over_mosquitto_solve_a_single_coordinators_head_and_replace_statistics(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path, 6)
    path = sharded_toml(tmp_path, mosquitto.address.port, keys, clients=6, method="lda", rounds=2)
    cfg = load_config(path)
    single = Single(tmp_path, method="lda", clients=6)
    settings = MqttSettings(host=mosquitto.address.host, port=mosquitto.address.port)
    watch = Watch(keys.public)
    handled = Handled()
    workers: dict[str, Worker] = {}

    def start(name: str) -> Worker:
        intake = Intake(name=name, admission=cfg.admission_checks(),
                        keys=CoordinatorKeys.load(cfg.security),
                        store=WorkerStore(tmp_path / f"worker-{name}.sqlite3"))  # fmt: skip
        worker = Worker(intake=intake, group="aggregators", mqtt_settings=settings,
                        on_update=handled)  # fmt: skip
        workers[name] = worker.start()
        assert worker.wait_heard(10)
        return worker

    def holds(name: str, round_: int, client: str) -> bool:
        open_ = workers[name].intake.open_round
        assert open_ is not None
        return workers[name].intake.store.update(open_.run, round_, client) is not None

    topics = (round_topic("lab"), collect_topic("lab"), "protofleet/v1/lab/receipt/+")
    try:
        with (
            connected(mosquitto.address, "devices", subscribe=topics) as (client, _),
            owner_service(cfg) as owner,
        ):
            client.on_message = watch.on_message
            watch.run = owner.run_id

            def publish(u: PrototypeUpdate) -> None:
                signed = sign(u, keys.devices[u.client], run=owner.run_id)
                client.publish(update_topic("lab", u.client), signed.to_wire(), qos=1)

            # Round 0 with w3 alone in the group: it stores every device's statistics.
            start("w3")
            first = [statistics(i, 0, method="lda") for i in range(6)]
            for u in first:
                publish(u)
            assert watch.wait(lambda: len(watch.receipted) == 6, timeout=10)
            start("w1")  # both in time for the owner's next collect request
            start("w2")
            assert watch.wait(lambda: any(a.round == 1 for a in watch.announced), timeout=10)
            round0 = owner.closed
            # Round 1: dev-0's second data version, sent again until w1 or w2 holds a copy
            # (the group hands messages out in turn): w3's first is then taken back.
            second = [nothing(i, 1, method="lda") for i in range(6)]
            second[0] = statistics(0, 1, method="lda", version=1)

            def moved() -> bool:
                return holds("w1", 1, "dev-0") or holds("w2", 1, "dev-0")

            for _ in range(6):
                before = handled.count
                publish(second[0])
                handled.wait(before + 1)
                if moved():
                    break
            assert moved()
            for u in second[1:]:
                publish(u)
            assert watch.wait(lambda: any(a.round == 2 for a in watch.announced), timeout=15)
            round1 = owner.closed
            final = next(a for a in watch.announced if a.round == 2)
            asked = [(c.round, c.worker, dict(c.retract)) for c in watch.collects if c.retract]
    finally:
        for w in workers.values():
            w.stop()
            w.intake.store.close()
    assert (
        round0 is not None
        and round0.round == 0
        and round0.merged.clients == {f"dev-{i}" for i in range(6)}
    )
    assert_same_head(round0.result, single.round(first))
    # dev-0's first statistics were asked back from w3, where round 0 stored them.
    assert (1, "w3", {"dev-0": 0}) in asked
    want = single.round(second)
    assert round1 is not None and round1.round == 1
    assert_same_head(round1.result, want)
    assert round1.statistics is not None and round1.statistics.devices == 6
    # Announced as the single coordinator announces it: model.announce_dtype = "f4".
    np.testing.assert_allclose(final.global_prototypes, want.global_prototypes.astype(np.float32),
                               rtol=1e-6)  # fmt: skip
    single.close()


class Handled:
    """Counts the updates the workers handled (stored, or refused as duplicates)."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def __call__(self, decision: object) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.count >= count, timeout=10)


@pytest.mark.parametrize("method", ["lda", "ridge", "fedcof"])
def test_the_closed_form_methods_run_over_workers_as_configured(method: str) -> None:
    # A closed-form fleet takes no [robust] table (coordinator/config.py): the defaults;
    # its per-client cap is said to need the single coordinator, which keeps them.
    why = refusal(sharded(method, robust=RobustOptions()))
    assert why is not None and "closed_form.count_cap" in why and "count_cap = 0" in why
    uncapped = ClosedFormSettings(count_cap=0)
    assert refusal(sharded(method, robust=RobustOptions(), closed_form=uncapped)) is None
