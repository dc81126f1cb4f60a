"""A closed-form device (edge_agent/closed_form.py and the agent's path for it): the
public projection, the statistics sent once per data version, the head it chooses on its
validation split, and `edge-agent predict` predicting with that head."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import closed_form as cf
from coordinator.strategies import make_strategy
from coordinator.strategies.closed_form import announced
from edge_agent.agent import Agent
from edge_agent.closed_form import (
    ClosedFormDevice,
    StatisticsRelease,
    StoredHead,
    choose,
    largest_dim,
    prepare,
    projection,
    statistics_bytes,
)
from edge_agent.config import ClosedFormSettings
from edge_agent.methods import device_method
from edge_agent.privacy.accounting import plan_features
from edge_agent.privacy.settings import PrivacySettings
from fleet.data import partition as part
from fleet.transports.runner import run
from fleet.transports.spec import RunSpec
from protocol import PrototypeUpdate, RoundAnnouncement
from protocol.methods import BASIS, BIAS, GRAM
from tests.agent_helpers import RUN, RUN_STARTED, agent_config


def test_the_projection_is_public_orthonormal_and_the_fleets_own():
    q = projection("lab", 40, 12)
    assert q is not None and q.shape == (40, 12)
    np.testing.assert_allclose(q.T @ q, np.eye(12), atol=1e-12)
    again, other = projection("lab", 40, 12), projection("other", 40, 12)
    assert again is not None and other is not None
    assert np.array_equal(q, again)  # every device draws the same
    assert not np.allclose(q, other)  # seeded from the fleet id
    assert projection("lab", 40, 40) is None
    with pytest.raises(ValueError, match="must be below the bundle's 40 features"):
        projection("lab", 40, 41)


def test_prepared_rows_have_norm_at_most_one():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 30)) * rng.uniform(0, 10, size=(50, 1))
    x[3] = 0.0
    for q in (None, projection("lab", 30, 8)):
        rows = prepare(x, q)
        assert np.linalg.norm(rows, axis=1).max() <= 1.0 + 1e-12
        assert np.array_equal(rows[3], np.zeros(rows.shape[1]))


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match=r"closed_form\.dim must be >= 0"):
        ClosedFormSettings(dim=-1)
    with pytest.raises(ValueError, match="personal_lambda must be positive"):
        ClosedFormSettings(personal_lambda=0.0)
    assert ClosedFormSettings(dim=0).size(896) == 896
    assert ClosedFormSettings(dim=64).size(896) == 64


def _blobs(seed: int, n: int, *, dim: int = 16, classes: int = 4, flip: bool = False,
           spread: float = 1.0):  # fmt: skip
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(size=(classes, dim)) * 2
    y = rng.integers(0, classes, size=n)
    x = centres[y] + rng.normal(size=(n, dim)) * spread
    return x, (classes - 1 - y if flip else y)


def _announcement(head: cf.LinearHead, round_: int = 1) -> RoundAnnouncement:
    agg = announced(head)
    return RoundAnnouncement(
        fleet="lab", round=round_, run=RUN, run_started=RUN_STARTED, bundle="b" * 64,
        method="lda", classes=tuple("abcd"), dim=head.weight.shape[1], deadline=0.0,
        params={"final": False}, global_classes=agg.global_classes,
        global_prototypes=np.asarray(agg.global_prototypes, np.float32),
        extras={BIAS: np.asarray(agg.extras[BIAS], np.float32)},
    )  # fmt: skip


def _device(tmp_path, x, y, **settings) -> ClosedFormDevice:
    return ClosedFormDevice(
        method=device_method("lda"), fleet="lab", features=x, labels=y, num_classes=4,
        settings=ClosedFormSettings(**settings), seed=0, state_dir=tmp_path,
    )  # fmt: skip


def test_a_device_takes_a_good_fleet_head_and_refuses_a_useless_one(tmp_path):
    # A small device with overlapping classes: its own head is a poor one.
    x, y = _blobs(1, 40, spread=4.0)
    device = _device(tmp_path, x, y)
    pooled_x, pooled_y = _blobs(2, 4000, spread=4.0)
    good = cf.lda_head(cf.device_statistics(prepare(pooled_x, None), pooled_y, 4))
    assert device.adopt(_announcement(good))
    assert device.choice in ("global", "personalised")
    # A fleet head that labels every class as another (its classes reversed): the
    # device's validation split says so, and it predicts with a head fitted to its own
    # data (its own, or the fleet's turned around by the personalising ridge).
    bad = cf.LinearHead(weight=good.weight[::-1].copy(), bias=good.bias[::-1].copy(),
                        present=good.present)  # fmt: skip
    assert device.adopt(_announcement(bad))
    assert device.choice in ("personalised", "own")
    assert device.val_accuracies["global"] < 0.5 < device.val_accuracies[device.choice]
    test_x, test_y = _blobs(3, 400, spread=4.0)
    own = (device.scores(test_x).argmax(axis=1) == test_y).mean()
    assert own > 0.5 > (bad.predict(prepare(test_x, None)) == test_y).mean()
    # What it chose is what its state folder keeps, for `edge-agent predict`.
    assert device.path is not None
    stored = StoredHead.load(device.path, fleet="lab", feature_dim=16,
                             settings=ClosedFormSettings(), num_classes=4)  # fmt: skip
    assert stored is not None and stored.choice == device.choice
    np.testing.assert_array_equal(stored.scores(test_x), device.scores(test_x))


def test_an_announcement_without_a_head_changes_nothing(tmp_path):
    x, y = _blobs(1, 40)
    device = _device(tmp_path, x, y)
    empty = dataclasses.replace(_announcement(cf.lda_head(cf.device_statistics(
        prepare(x, None), y, 4))), global_classes=(), global_prototypes=np.zeros((0, 0),
        np.float32), extras={})  # fmt: skip
    assert not device.adopt(empty)
    assert device.head is None
    with pytest.raises(LookupError, match="no closed-form head yet"):
        device.scores(x)


@pytest.mark.slow
def test_an_agent_sends_its_statistics_until_stored_then_nothing(small_zoo, tmp_path):
    cfg = agent_config(tmp_path / "a", small_zoo, agent_id="dev-a", domain="clean",
                       method="lda")  # fmt: skip
    cfg = dataclasses.replace(cfg, closed_form=ClosedFormSettings(dim=24))
    agent = Agent(cfg)
    start = RoundAnnouncement(fleet="lab", round=0, run=RUN, run_started=RUN_STARTED,
                              bundle=agent.bundle_id, method="lda", classes=cfg.classes,
                              dim=agent.prototype_dim, deadline=0.0, params={"final": False})  # fmt: skip
    first = agent.handle(start)
    assert first.reason == "answered" and first.payload is not None
    update = PrototypeUpdate.from_wire(first.payload)
    stats = cf.device_statistics(agent.closed.x, agent.train_labels, 10)  # type: ignore[union-attr]
    assert update.prototypes.dtype == np.float64 and update.prototypes.shape[1] == 24
    np.testing.assert_array_equal(update.prototypes, stats.sums[list(update.classes)])
    assert stats.gram is not None
    np.testing.assert_array_equal(update.extras[GRAM], cf.upper_triangle(stats.gram))
    assert sum(update.counts) == len(agent.train_labels)
    # The coordinator's head arrives, but no receipt came for round 0: the statistics
    # travel again, since nothing says the coordinator holds them.
    head = make_strategy("lda").aggregate([update], num_classes=10, dim=24)
    nxt = dataclasses.replace(
        start, round=1, global_classes=head.global_classes,
        global_prototypes=np.asarray(head.global_prototypes, np.float32),
        extras={BIAS: np.asarray(head.extras[BIAS], np.float32)},
    )  # fmt: skip
    again = agent.handle(nxt)
    assert PrototypeUpdate.from_wire(again.payload).classes == update.classes
    assert agent.state.snapshot.history[0]["test_accuracy"] is not None  # scored on the head
    # Round 1's update is stored (its receipt came): round 2 carries no rows at all.
    agent.confirmed(1)
    later = agent.handle(dataclasses.replace(nxt, round=2))
    assert later.payload is not None
    small = PrototypeUpdate.from_wire(later.payload)
    assert small.classes == () and not small.extras and len(later.payload) < 2000
    # A restart keeps that: the device does not send its statistics a second time.
    restarted = Agent(cfg)
    last = restarted.handle(dataclasses.replace(nxt, round=3))
    assert PrototypeUpdate.from_wire(last.payload).classes == ()
    # A coordinator of a new run (its database lost or moved aside) holds none of them:
    # they travel again, the same statistics, with their basis check.
    fresh = restarted.handle(dataclasses.replace(start, run="f" * 16, run_started=RUN_STARTED + 1))
    resent = PrototypeUpdate.from_wire(fresh.payload)
    assert resent.classes == update.classes and BASIS in resent.extras
    np.testing.assert_array_equal(resent.prototypes, update.prototypes)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lda", "fedcof"])
def test_a_noisy_release_is_paid_for_once_and_sent_again_unchanged(small_zoo, tmp_path, method):
    z = plan_features(epsilon_target=4.0, delta=1e-5).release_noise_multiplier
    cfg = agent_config(tmp_path / "a", small_zoo, agent_id="dev-a", domain="clean",
                       method=method)  # fmt: skip
    cfg = dataclasses.replace(
        cfg, closed_form=ClosedFormSettings(dim=16),
        privacy=PrivacySettings(mechanism="dp-features", epsilon=4.0,
                                release_noise_multiplier=z),
    )  # fmt: skip
    agent = Agent(cfg)
    start = RoundAnnouncement(fleet="lab", round=0, run=RUN, run_started=RUN_STARTED,
                              bundle=agent.bundle_id, method=method, classes=cfg.classes,
                              dim=agent.prototype_dim, deadline=0.0, params={"final": False})  # fmt: skip
    first = agent.handle(start)
    assert first.payload is not None
    sent = PrototypeUpdate.from_wire(first.payload)
    # Every class, present or not; noisy counts as floats; the epsilon of one release.
    assert sent.classes == tuple(range(10))
    assert sent.privacy.mechanism == "dp-features" and sent.privacy.epsilon is not None
    assert 0 < sent.privacy.epsilon <= 4.0
    exact = agent.closed.release()  # type: ignore[union-attr]
    assert not np.allclose(sent.prototypes[exact.classes], exact.rows)  # noised
    assert (GRAM in sent.extras) == (method == "lda")
    # No receipt came: round 1 sends the very same release again, at no new cost.
    again = PrototypeUpdate.from_wire(agent.handle(dataclasses.replace(start, round=1)).payload)
    assert np.array_equal(again.prototypes, sent.prototypes)
    assert again.counts == sent.counts and again.privacy.epsilon == sent.privacy.epsilon
    assert len(agent.mode.ledger.history) == 1
    # A restart (the ledger and the stored release survive it) changes nothing either.
    restarted = Agent(cfg)
    third = PrototypeUpdate.from_wire(restarted.handle(dataclasses.replace(start, round=2)).payload)
    assert np.array_equal(third.prototypes, sent.prototypes)
    assert restarted.epsilon_spent == pytest.approx(sent.privacy.epsilon)


@pytest.mark.parametrize(("method", "per_unit"), [("lda", 3**0.5), ("ridge", 3**0.5),
                                                  ("fedcof", 2**0.5)])  # fmt: skip
def test_a_noisy_release_adds_the_mechanisms_noise_to_everything_it_sends(tmp_path, method,
                                                                          per_unit):  # fmt: skip
    # The noise's standard deviation is the multiplier times the release's L2
    # sensitivity: sqrt(3) with a second moment (G, s, n), sqrt(2) without (s, n).
    x, y = _blobs(1, 60)
    device = ClosedFormDevice(
        method=device_method(method), fleet="lab", features=x, labels=y, num_classes=4,
        settings=ClosedFormSettings(), seed=0, state_dir=None,
    )  # fmt: skip
    exact = device.release()
    rng = np.random.default_rng(0)
    diffs = []
    for _ in range(50):
        noisy = device.noisy_release(2.0, rng)
        assert list(noisy.classes) == [0, 1, 2, 3]  # every class, held or not
        diffs += [noisy.rows - exact.rows, noisy.counts - exact.counts]
        if exact.gram is not None:
            assert noisy.gram is not None
            diffs.append(cf.upper_triangle(noisy.gram) - cf.upper_triangle(exact.gram))
        else:
            assert noisy.gram is None
    spread = float(np.std(np.concatenate([d.ravel() for d in diffs])))
    assert spread == pytest.approx(2.0 * per_unit, rel=0.03)


def test_an_update_that_would_not_fit_the_payload_cap_names_the_largest_dim():
    k = largest_dim(4 << 20, classes=10, gram=True)
    assert statistics_bytes(k, classes=10, gram=True) <= 4 << 20
    assert statistics_bytes(k + 1, classes=10, gram=True) > 4 << 20
    # The bound holds for a real update of that size.
    rng = np.random.default_rng(0)
    x = cf.clip_rows(rng.normal(size=(30, 40)))
    stats = cf.device_statistics(x, rng.integers(0, 10, size=30), 10)
    wire = StatisticsRelease.of(stats).update(fleet="lab", round_=0, client="c", bundle="b" * 64,
                                             method="lda").to_wire()  # fmt: skip
    assert len(wire) <= statistics_bytes(40, classes=10, gram=True)


def test_the_device_keeps_its_own_head_unless_another_earns_its_place():
    # 20 validation samples: one more right is 0.05.
    assert choose({"global": 0.80, "personalised": 0.70, "own": 0.70}, validation=20) == "global"
    assert choose({"global": 0.74, "personalised": 0.70, "own": 0.70}, validation=20) == "own"
    assert choose({"global": 0.75, "personalised": 0.75, "own": 0.70}, validation=20) == "global"
    assert choose({"global": 0.60, "personalised": 0.80, "own": 0.75}, validation=20) == (
        "personalised"
    )
    assert choose({"global": 0.0, "personalised": 0.0, "own": 0.0}, validation=0) == "own"


@pytest.mark.broker
@pytest.mark.slow
def test_over_mosquitto_the_statistics_travel_once_and_score_as_in_memory(small_zoo, tmp_path):
    """The agents' services over a real Mosquitto: the statistics leave each device in
    round 0 and, once the coordinator's receipt came, never again; every device's scores
    are those of the in-process fleet."""
    partition = part.digits5(clients=2, split="feature", seed=3, train=40, test=30)
    results = {}
    for transport in ("mqtt", "memory"):
        spec = RunSpec(method="lda", rounds=3, bundle=small_zoo, out=tmp_path / transport,
                       transport=transport, workers=1, stats_dim=24, progress=False)  # fmt: skip
        results[transport] = run(spec, partition)
    for client in results["mqtt"].clients:
        first, *later = client.bytes_up
        assert first > 4000 and all(0 < b < 2000 for b in later), client.bytes_up
    assert [c.accuracy for c in results["mqtt"].clients] == [
        c.accuracy for c in results["memory"].clients
    ]
    assert all(a is not None for c in results["mqtt"].clients for a in c.accuracy)
