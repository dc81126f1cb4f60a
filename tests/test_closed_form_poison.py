"""A closed-form fleet that one device cannot leave without a head: a secure sum that
fails the checks on the unmasked sum keeps the last head (coordinator/rounds/secure_checks.py),
a plain round that loses a class keeps it (coordinator/rounds/head_guard.py), and a
client's statistics can be dropped (``Store.forget``), and those of a client dropped or no
longer enrolled are left out of the sum a start or reload rebuilds."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess

import numpy as np

import closed_form as cf
from coordinator.config import CoordinatorConfig, RoundSettings
from coordinator.config import load as load_config
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.head_guard import HEAD_KEY, refusal
from coordinator.rounds.secure import SecureOutcome
from coordinator.rounds.stored import RunningStatistics
from coordinator.storage.store import Store
from coordinator.strategies import Aggregate
from coordinator.strategies.closed_form import LDA
from edge_agent.closed_form import StatisticsRelease
from fleet.transports.secure import coordinator_tables
from protocol.auth import sign
from runtime.security import CoordinatorSecurity
from runtime.settings import build
from secagg.fleet import SecureAggregation, flatten
from tests.coordinator_helpers import BIN, DIM, coordinator_toml
from tests.coordinator_helpers import BUNDLE as HELPER_BUNDLE
from tests.test_coordinator_closed_form import BUNDLE, C, K, _config, devices, update_of
from tests.test_worker_intake import make_keys

SAMPLES = 100  # secure_aggregation.dataset_size: the quantiser's clip


def _secure_manager(tmp_path, metrics: Metrics) -> RoundManager:
    table = SecureAggregation(threshold=2, epsilon=0.0, dataset_size=SAMPLES)
    config = build(CoordinatorConfig, {
        "fleet": "lab", "state_dir": str(tmp_path / "coordinator"),
        "model": {"method": "lda", "bundle": "b", "classes": [str(c) for c in range(C)],
                  "dim": K},
        "rounds": {"min_clients": 3},
        "security": {"insecure": True}, **coordinator_tables(table, method="lda"),
    })  # fmt: skip
    return RoundManager(config=config, store=Store(config.database), metrics=metrics)


def test_a_poisoned_secure_sum_is_refused_and_the_last_head_kept(tmp_path, caplog):
    metrics = Metrics()
    manager = _secure_manager(tmp_path, metrics)
    honest = [cf.device_statistics(x, y, C) for x, y in devices(21, count=4)[1:]]
    total = flatten(cf.merge(honest), gram=True)
    assert manager.take_secure(SecureOutcome(round=0, total=total, survivors=3))
    first = manager.poll()
    assert first is not None and len(first.global_classes) == C
    # One device's input, every coordinate within the ring's clip (dataset_size): counts
    # of -100 on every class (more than the fleet holds) and a negative second moment.
    poison = cf.Statistics(counts=np.full(C, -float(SAMPLES)), sums=np.zeros((C, K)),
                           gram=-float(SAMPLES) * np.eye(K), holders=np.zeros(C, np.int64),
                           scatter=None, devices=1)  # fmt: skip
    caplog.set_level(logging.WARNING)
    assert manager.take_secure(
        SecureOutcome(round=1, total=flatten(poison, gram=True), survivors=1)
    )
    second = manager.poll()
    assert second is not None and second.round == 2
    assert second.global_classes == first.global_classes
    np.testing.assert_array_equal(second.global_prototypes, first.global_prototypes)
    assert "the secure sum of round 1 fails admission (negative_count)" in caplog.text
    assert metrics.value("protofleet_head_kept") == 1.0
    kept = json.loads(manager.store.meta_value(HEAD_KEY) or "null")
    assert kept["round"] == 1 and "round 1" in kept["why"]
    # The refused round is not in the fleet's sum: an honest round after it solves again.
    assert manager.take_secure(SecureOutcome(round=2, total=total * 0, survivors=2))
    third = manager.poll()
    assert third is not None and metrics.value("protofleet_head_kept") == 0.0
    np.testing.assert_allclose(third.global_prototypes, first.global_prototypes, rtol=1e-6)
    manager.store.close()


def _plain(tmp_path, metrics: Metrics) -> RoundManager:
    cfg = _config(tmp_path)
    return RoundManager(config=cfg, store=Store(cfg.database), metrics=metrics,
                        clock=lambda: 0.0)  # fmt: skip


def test_a_forgotten_clients_statistics_leave_the_sum_at_the_next_start(tmp_path):
    data = devices(22, count=3)
    m = _plain(tmp_path, Metrics())
    for i, (x, y) in enumerate(data):
        u = update_of(x, y, f"d{i}", method="lda")
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
    assert m.poll() is not None
    assert m.store.forget("d2") and not m.store.forget("nobody")
    m.store.close()
    again = _plain(tmp_path, Metrics())  # a restart, or a reload (SIGHUP) of the service
    assert isinstance(again.tally, RunningStatistics)
    assert again.tally.statistics.held == {"d0", "d1"}
    for client in ("d0", "d1"):
        nothing = StatisticsRelease.nothing(K).update(
            fleet="lab", round_=1, client=client, bundle=BUNDLE, method="lda"
        )
        assert again.offer(nothing.to_wire(), topic_client=client).accepted
    head = again.poll()
    assert head is not None
    want = LDA().solve_statistics(cf.merge([cf.device_statistics(x, y, C) for x, y in data[:2]]))
    np.testing.assert_allclose(head.global_prototypes, want.global_prototypes.astype(np.float32),
                               rtol=1e-5)  # fmt: skip
    again.store.close()


def test_a_device_whose_key_is_removed_leaves_the_sum_at_the_next_start(tmp_path, caplog):
    keys = make_keys(tmp_path, 3)
    cfg = dataclasses.replace(
        _config(tmp_path),
        security=CoordinatorSecurity(key=keys.folder / "coordinator.key",
                                     devices=keys.folder / "devices"),
        rounds=RoundSettings(min_clients=1, wait_after_quorum_s=0.0, timeout_s=100.0),
    )  # fmt: skip
    m = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=lambda: 0.0)
    data = devices(23, count=3)
    for i, (x, y) in enumerate(data):
        signed = sign(update_of(x, y, f"dev-{i}", method="lda"), keys.devices[f"dev-{i}"],
                      run=m.run_id)  # fmt: skip
        assert m.offer(signed.to_wire(), topic_client=signed.client).accepted
    assert m.poll() is not None
    m.store.close()
    (keys.folder / "devices" / "dev-2.pub").unlink()  # unenrolled; then a restart or reload
    again = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(),
                         clock=lambda: 0.0)  # fmt: skip
    assert "the stored statistics of dev-2 are left out: unenrolled" in caplog.text
    assert isinstance(again.tally, RunningStatistics)
    assert again.tally.statistics.held == {"dev-0", "dev-1"}
    again.store.close()


def test_the_forget_command_drops_a_clients_statistics_and_refuses_an_unknown_one(tmp_path):
    path = coordinator_toml(tmp_path, 1, method="lda", clients=1)
    cfg = load_config(path)
    m = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=lambda: 0.0)
    rng = np.random.default_rng(24)
    for client in ("dev-0", "dev-1"):
        y = np.arange(12) % 3
        stats = cf.device_statistics(cf.clip_rows(rng.normal(size=(12, DIM))), y, 3)
        u = StatisticsRelease.of(stats).update(fleet="lab", round_=0, client=client,
                                               bundle=HELPER_BUNDLE, method="lda")  # fmt: skip
        assert m.offer(u.to_wire(), topic_client=client).accepted
    assert m.poll() is not None
    m.store.close()
    forget = [str(BIN / "edge-coordinator"), "forget", "--config", str(path)]
    done = subprocess.run([*forget, "dev-1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "forgot the statistics of dev-1" in done.stdout
    again = Store(cfg.database)
    assert again.statistics_clients() == ["dev-0"]
    again.close()
    done = subprocess.run([*forget, "dev-1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "holds no statistics of 'dev-1'" in done.stderr


def test_a_round_whose_statistics_solve_no_head_announces_the_last_one(tmp_path, caplog):
    metrics = Metrics()
    m = _plain(tmp_path, metrics)
    data = devices(25, count=3)
    for i, (x, y) in enumerate(data[:2]):
        u = update_of(x, y, f"d{i}", method="lda")
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
    first = m.poll()
    assert first is not None and len(first.global_classes) == C
    # Statistics no head solves (refused by admission today; a solver that fails stands
    # in for whatever gets past it): the head stays, said with the client that sent them.
    assert isinstance(m.strategy, LDA)

    def no_head(stats: cf.Statistics, *, noise_std: float = 0.0) -> Aggregate:
        return Aggregate()

    m.strategy.solve_statistics = no_head  # type: ignore[method-assign]
    x, y = data[2]
    u = update_of(x, y, "d2", method="lda", round_=1)
    assert m.offer(u.to_wire(), topic_client="d2").accepted
    nothing = StatisticsRelease.nothing(K).update(fleet="lab", round_=1, client="d0",
                                                  bundle=BUNDLE, method="lda")  # fmt: skip
    assert m.offer(nothing.to_wire(), topic_client="d0").accepted
    caplog.set_level(logging.WARNING)
    second = m.poll()
    assert second is not None and second.global_classes == first.global_classes
    np.testing.assert_array_equal(second.global_prototypes, first.global_prototypes)
    assert "statistics changed by: d2" in caplog.text
    assert metrics.value("protofleet_head_kept") == 1.0
    summary = m.store.summary()
    assert summary["head_kept"] == {"round": 1, "why": "its statistics solve no head",
                                    "clients": ["d2"]}  # fmt: skip
    m.store.close()


def test_a_head_may_lose_a_class_only_when_no_device_holds_it_any_more(tmp_path):
    m = _plain(tmp_path, Metrics())
    for i, (x, y) in enumerate(devices(26, count=3)[1:]):  # devices of every class
        u = update_of(x, y, f"d{i}", method="lda")
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
    last = m.poll()
    assert last is not None and last.global_classes == tuple(range(C))
    m.store.close()
    fewer = Aggregate(global_classes=(0, 1, 2), global_prototypes=np.zeros((3, K)))
    assert refusal(Aggregate(), last) == "its statistics solve no head"
    assert refusal(fewer, last, held=frozenset({0, 1, 2})) == ""  # class 3: nobody's now
    assert "lacks class(es) [3]" in refusal(fewer, last, held=frozenset(range(C)))
    assert "lacks class(es) [3]" in refusal(fewer, last)  # a secure sum: any class lost
