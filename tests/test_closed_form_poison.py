"""A closed-form fleet that one device cannot leave without a head: a secure sum that
fails the checks on the unmasked sum keeps the last head (coordinator/rounds/secure_checks.py),
a plain round that loses a class keeps it (coordinator/rounds/head_guard.py), and a
client's statistics can be dropped (``Store.forget``) and are left out of the rebuilt sum."""

from __future__ import annotations

import json
import logging

import numpy as np

import closed_form as cf
from coordinator.config import CoordinatorConfig
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.head_guard import HEAD_KEY
from coordinator.rounds.secure import SecureOutcome
from coordinator.rounds.stored import RunningStatistics
from coordinator.storage.store import Store
from coordinator.strategies.closed_form import LDA
from edge_agent.closed_form import StatisticsRelease
from fleet.transports.secure import coordinator_tables
from runtime.settings import build
from secagg.fleet import SecureAggregation, flatten
from tests.test_coordinator_closed_form import BUNDLE, C, K, _config, devices, update_of

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
