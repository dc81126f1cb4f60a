"""The closed-form strategies (lda, ridge, fedcof) and their rounds: the coordinator's
solution is the pooled head of every device's raw features, however the devices' updates
are split into partial sums, and a client's statistics count once across rounds and
restarts."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import numpy as np
import pytest

import closed_form as cf
from coordinator.closed_form_settings import ClosedFormSettings
from coordinator.config import CoordinatorConfig, ModelSettings, RoundSettings
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.stored import RunningStatistics
from coordinator.storage.store import Store
from coordinator.strategies import RobustOptions, make_strategy
from coordinator.strategies.closed_form import fleet_statistics
from edge_agent.closed_form import StatisticsRelease
from protocol import PrototypeUpdate
from protocol.methods import BASIS, BIAS, GRAM
from runtime.security import CoordinatorSecurity

K, C = 6, 4
BUNDLE = "f" * 64


def devices(seed: int = 0, count: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    """Raw rows (norm <= 1) and labels of ``count`` devices, of uneven sizes; device 0
    lacks class 3."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(C, K))
    out = []
    for d in range(count):
        n = int(rng.integers(5, 40))
        y = rng.integers(0, C - 1 if d == 0 else C, size=n)
        x = cf.clip_rows((centres[y] + rng.normal(size=(n, K))) / 3.0)
        out.append((x, y))
    return out


def update_of(x: np.ndarray, y: np.ndarray, client: str, *, method: str, round_: int = 0):
    """A device's statistics update as an agent sends it (edge_agent/agent.py)."""
    stats = cf.device_statistics(x, y, C, gram=method != "fedcof")
    update = StatisticsRelease.of(stats).update(
        fleet="lab", round_=round_, client=client, bundle=BUNDLE, method=method
    )
    # Through the wire: what the coordinator sums is what travelled.
    return PrototypeUpdate.from_wire(update.to_wire())


def pooled_lda(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LDA from the pooled raw rows, the slow obvious way: class means, within-class
    covariance, OAS shrinkage toward a scaled identity."""
    present = np.unique(y)
    mus = np.stack([x[y == c].mean(axis=0) for c in present])
    centred = x - mus[np.searchsorted(present, y)]
    sigma = centred.T @ centred / (len(y) - len(present))
    rho = cf.oas_shrinkage(sigma, float(len(y)))
    sigma = (1 - rho) * sigma + rho * np.trace(sigma) / K * np.eye(K)
    w = np.linalg.solve(sigma, mus.T).T
    prior = np.log(np.array([np.mean(y == c) for c in present]))
    b = -0.5 * np.einsum("ck,ck->c", w, mus) + prior
    return w, b


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_coordinators_lda_is_the_pooled_lda_for_any_split_into_partial_sums(seed):
    data = devices(seed)
    updates = [update_of(x, y, f"d{i}", method="lda") for i, (x, y) in enumerate(data)]
    x_all = np.concatenate([x for x, _ in data])
    y_all = np.concatenate([y for _, y in data])
    w, b = pooled_lda(x_all, y_all)
    solved = make_strategy("lda").aggregate(updates, num_classes=C, dim=K)
    assert solved.global_classes == (0, 1, 2, 3)
    np.testing.assert_allclose(solved.global_prototypes, w, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(solved.extras[BIAS], b, rtol=1e-8, atol=1e-10)
    rng = np.random.default_rng(100 + seed)
    for _ in range(5):
        # Any split of the devices into groups, each summed apart, merged in any order.
        groups = rng.integers(0, 3, size=len(updates))
        parts = [
            fleet_statistics([u for u, g in zip(updates, groups, strict=True) if g == k],
                             num_classes=C, dim=K)
            for k in rng.permutation(3)
        ]  # fmt: skip
        head = cf.lda_head(cf.denoise(cf.merge(p for p in parts if p is not None)))
        np.testing.assert_allclose(head.weight, w, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(head.bias, b, rtol=1e-8, atol=1e-10)


def test_the_coordinators_ridge_is_the_pooled_ridge():
    data = devices(3)
    updates = [update_of(x, y, f"d{i}", method="ridge") for i, (x, y) in enumerate(data)]
    x_all = np.concatenate([x for x, _ in data])
    y_all = np.concatenate([y for _, y in data])
    onehot = np.eye(C)[y_all]
    w = np.linalg.solve(x_all.T @ x_all + 0.1 * np.eye(K), x_all.T @ onehot).T
    solved = make_strategy("ridge", lam=0.1).aggregate(updates[::-1], num_classes=C, dim=K)
    np.testing.assert_allclose(solved.global_prototypes, w, rtol=1e-8, atol=1e-12)
    assert np.array_equal(solved.extras[BIAS], np.zeros(C))


def test_fedcof_is_solved_from_means_and_counts_alone():
    data = devices(4, count=30)
    updates = [update_of(x, y, f"d{i}", method="fedcof") for i, (x, y) in enumerate(data)]
    assert all(set(u.extras) == {"counts", BASIS} for u in updates)  # prototype-sized: no moment
    solved = make_strategy("fedcof").aggregate(updates, num_classes=C, dim=K)
    stats = cf.merge(cf.means_statistics(*_dense(u)) for u in updates)
    np.testing.assert_allclose(
        solved.global_prototypes, cf.fedcof_head(stats, lam=0.1).weight, rtol=1e-8
    )


def _dense(update: PrototypeUpdate) -> tuple[np.ndarray, np.ndarray]:
    counts, sums = np.zeros(C), np.zeros((C, K))
    counts[list(update.classes)] = update.counts
    sums[list(update.classes)] = update.prototypes
    return counts, sums / np.maximum(counts, 1.0)[:, None]


def test_a_strategys_parameters_are_checked_by_name_and_range():
    with pytest.raises(ValueError, match="shrinkage must be in"):
        make_strategy("lda", shrinkage=2.0)
    with pytest.raises(ValueError, match="lam must be positive"):
        make_strategy("ridge", lam=0.0)
    with pytest.raises(ValueError, match="has no parameter 'tau'"):
        make_strategy("fedcof", tau=1.0)


def _config(state_dir: Path, method: str = "lda") -> CoordinatorConfig:
    return CoordinatorConfig(
        fleet="lab",
        state_dir=state_dir,
        model=ModelSettings(method=method, bundle=BUNDLE, classes=tuple("abcd"), dim=K),
        rounds=RoundSettings(min_clients=2, wait_after_quorum_s=0.0, timeout_s=100.0),
        security=CoordinatorSecurity(insecure=True),
        # The pooled head exactly: these devices' sizes differ up to eightfold, which the
        # default cap would even out (its own tests: test_closed_form_robust.py).
        closed_form=ClosedFormSettings(count_cap=0),
    )


def _manager(state_dir: Path) -> RoundManager:
    cfg = _config(state_dir)
    return RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=lambda: 0.0)


def _empty(client: str, round_: int) -> PrototypeUpdate:
    return PrototypeUpdate(fleet="lab", round=round_, client=client, bundle=BUNDLE, method="lda",
                           classes=(), counts=(), prototypes=np.zeros((0, K)))  # fmt: skip


def test_statistics_sent_once_keep_the_head_across_rounds_and_a_restart(tmp_path):
    (x0, y0), (x1, y1) = devices(5, count=2)
    m = _manager(tmp_path)
    for u in (update_of(x0, y0, "d0", method="lda"), update_of(x1, y1, "d1", method="lda")):
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
    first = m.poll()
    assert first is not None and first.round == 1 and len(first.global_classes) == C
    # Round 1: both devices have nothing new; the same head is announced again.
    for client in ("d0", "d1"):
        assert m.offer(_empty(client, 1).to_wire(), topic_client=client).accepted
    second = m.poll()
    assert second is not None
    assert np.array_equal(second.global_prototypes, first.global_prototypes)
    m.store.close()
    # A restart solves from the stored statistics; new data from d1 replaces its old.
    m = _manager(tmp_path)
    assert m.round == 2
    x1b, y1b = devices(6, count=1)[0]
    assert m.offer(_empty("d0", 2).to_wire(), topic_client="d0").accepted
    newer = update_of(x1b, y1b, "d1", method="lda", round_=2)
    assert m.offer(newer.to_wire(), topic_client="d1").accepted
    third = m.poll()
    assert third is not None
    w, _ = pooled_lda(np.concatenate([x0, x1b]), np.concatenate([y0, y1b]))
    np.testing.assert_allclose(third.global_prototypes, w.astype(np.float32), rtol=1e-5)
    m.store.close()


def test_a_statistics_update_with_the_wrong_shape_or_extras_is_refused(tmp_path):
    m = _manager(tmp_path)
    (x, y) = devices(7, count=1)[0]
    good = update_of(x, y, "d0", method="lda")
    no_gram = PrototypeUpdate(fleet="lab", round=0, client="d1", bundle=BUNDLE, method="lda",
                              classes=good.classes, counts=good.counts,
                              prototypes=good.prototypes,
                              extras={BASIS: good.extras[BASIS]})  # fmt: skip
    assert m.offer(no_gram.to_wire(), topic_client="d1").reason == "wrong_extras"
    stray = PrototypeUpdate(fleet="lab", round=0, client="d2", bundle=BUNDLE, method="lda",
                            classes=(), counts=(), prototypes=np.zeros((0, K)),
                            extras={GRAM: good.extras[GRAM]})  # fmt: skip
    assert m.offer(stray.to_wire(), topic_client="d2").reason == "wrong_extras"
    assert m.offer(good.to_wire(), topic_client="d0").accepted
    m.store.close()


def _two_devices_stored(tmp_path: Path, *, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two devices' statistics stored by a closed round 0, the coordinator stopped."""
    data = devices(seed, count=2)
    m = _manager(tmp_path)
    for i, (x, y) in enumerate(data):
        u = update_of(x, y, f"d{i}", method="lda")
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
    assert m.poll() is not None
    m.store.close()
    return data


def test_a_stored_statistics_row_that_no_longer_decodes_is_left_out_on_restart(tmp_path, caplog):
    (x0, y0), _ = _two_devices_stored(tmp_path, seed=8)
    with sqlite3.connect(tmp_path / "coordinator.sqlite3") as db:
        db.execute("UPDATE statistics SET payload = ? WHERE client = 'd1'", (b"junk",))
    again = _manager(tmp_path)  # starts: the service must not fail every restart
    assert "the stored statistics of d1 are left out" in caplog.text
    for client in ("d0", "d1"):
        assert again.offer(_empty(client, 1).to_wire(), topic_client=client).accepted
    head = again.poll()
    assert head is not None  # solved from what was left: d0's statistics alone
    w, _ = pooled_lda(x0, y0)
    np.testing.assert_allclose(head.global_prototypes, w.astype(np.float32), rtol=1e-5)
    again.store.close()


def test_exact_statistics_no_device_can_hold_are_refused(tmp_path):
    checks = _config(tmp_path).admission_checks()
    x, y = devices(9, count=1)[0]
    good = update_of(x, y, "d0", method="lda")
    assert checks.check(good) is None
    replace = dataclasses.replace
    # A class sum longer than its count: some row had norm above 1.
    long = np.asarray(good.prototypes) * 3.0
    assert checks.check(replace(good, prototypes=long)) == "implausible_statistics"
    # Counts that disagree with the counts as drawn, or are not whole.
    half = {**good.extras, "counts": np.asarray(good.extras["counts"]) + 0.5}
    assert checks.check(replace(good, extras=half)) == "implausible_statistics"
    # A second moment whose trace exceeds the number of samples (each adds ||x||^2 <= 1).
    gram = np.asarray(good.extras[GRAM]) * 50.0
    assert checks.check(replace(good, extras={**good.extras, GRAM: gram})) == (
        "implausible_statistics"
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_the_running_sum_over_rounds_gives_the_pooled_lda(tmp_path, seed):
    """The production path: each device's statistics arrive in a round of their own
    (spread at random over three rounds, in random order), are summed on arrival and
    across closes, and the solved head is the pooled LDA to 1e-8."""
    data = devices(10 + seed)
    rng = np.random.default_rng(seed)
    arrival = rng.integers(0, 3, size=len(data))
    m = _manager(tmp_path)
    for round_ in range(3):
        for i in rng.permutation(len(data)):
            x, y = data[i]
            u = (update_of(x, y, f"d{i}", method="lda", round_=round_)
                 if arrival[i] == round_ else _empty(f"d{i}", round_))  # fmt: skip
            assert m.offer(u.to_wire(), topic_client=u.client).accepted
        assert m.poll() is not None
    w, b = pooled_lda(np.concatenate([x for x, _ in data]), np.concatenate([y for _, y in data]))
    assert isinstance(m.tally, RunningStatistics)
    solved = m.tally.solved  # the coordinator's float64 solution, before the cast
    assert solved is not None
    np.testing.assert_allclose(solved.global_prototypes, w, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(solved.extras[BIAS], b, rtol=1e-8, atol=1e-10)
    m.store.close()


def test_statistics_kept_under_another_dimension_are_left_out_on_restart(tmp_path, caplog):
    _two_devices_stored(tmp_path, seed=12)
    cfg = _config(tmp_path)
    smaller = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dim=K - 1))
    again = RoundManager(config=smaller, store=Store(smaller.database), metrics=Metrics(),
                         clock=lambda: 0.0)  # fmt: skip
    assert caplog.text.count("are left out: wrong_dim") == 2
    again.store.close()


def test_robust_options_are_refused_for_a_closed_form_fleet(tmp_path):
    with pytest.raises(ValueError, match=r"\[robust\] does not apply to lda"):
        dataclasses.replace(_config(tmp_path), robust=RobustOptions(rule="median"))


def test_lda_of_noisy_statistics_is_far_above_chance():
    # Five devices of 200 samples, each noising its own (G, s, n) as at epsilon 8: without
    # the within-class covariance made positive semi-definite before the shrinkage, the
    # solved directions turn away from the class means and the head falls below chance.
    rng = np.random.default_rng(0)
    k, c = 32, 4
    centres = cf.clip_rows(rng.normal(size=(c, k)))
    parts = []
    for _ in range(5):
        y = rng.integers(0, c, size=200)
        x = cf.clip_rows(centres[y] * 0.6 + rng.normal(size=(200, k)) * 0.08)
        parts.append(cf.noised(cf.device_statistics(x, y, c), sigma=0.6 * cf.SENSITIVITY,
                               rng=rng))  # fmt: skip
    head = cf.lda_head(cf.denoise(cf.merge(parts)))
    y = rng.integers(0, c, size=2000)
    x = cf.clip_rows(centres[y] * 0.6 + rng.normal(size=(2000, k)) * 0.08)
    assert (head.predict(x) == y).mean() > 0.9
