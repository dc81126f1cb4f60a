"""One device's weight in the fleet's statistics, capped (closed_form/robust.py), and the
single coordinator summing with the cap on by default."""

from __future__ import annotations

import numpy as np
import pytest

import closed_form as cf
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.stored import RunningStatistics
from coordinator.storage.store import Store
from coordinator.strategies.closed_form import LDA
from tests.test_coordinator_closed_form import C, K, _config, devices, update_of


def test_the_cap_is_a_multiple_of_the_lower_median_holders_count():
    counts = np.array([[10.0, 0.0], [12.0, 5.0], [1000.0, 6.0]])
    # Class 0: holders 10, 12, 1000, lower median 12; class 1: holders 5, 6, lower 5.
    np.testing.assert_array_equal(cf.count_caps(counts, 2.0), [24.0, 10.0])
    assert cf.count_caps(np.zeros((2, 1)), 2.0)[0] == np.inf  # nobody holds it
    with pytest.raises(ValueError, match="multiple"):
        cf.count_caps(counts, 0.5)


def test_a_capped_device_keeps_its_means_and_spread_at_a_lower_weight():
    # Rows (1, 0) and (0, 1) of class 0, (1, 0) of class 1; class 0 capped at 1 sample.
    part = cf.device_statistics(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]),
                                np.array([0, 0, 1]), 2)  # fmt: skip
    out = cf.capped(part, np.array([1.0, np.inf]))
    np.testing.assert_allclose(out.counts, [1.0, 1.0])
    np.testing.assert_allclose(out.sums, [[0.5, 0.5], [1.0, 0.0]])
    # W = [[.5, -.5], [-.5, .5]] at the device's overall weight (0.5 * 2 + 1) / 3 = 2/3,
    # plus w_c s_c s_c^T / n_c: 0.5 * [[.5, .5], [.5, .5]] + [[1, 0], [0, 0]].
    assert out.gram is not None
    np.testing.assert_allclose(out.gram, np.array([[19, -1], [-1, 7]]) / 12)
    assert cf.capped(part, np.array([2.0, 1.0])) is part  # nothing above its cap


def test_one_device_claiming_a_hundredfold_counts_weighs_at_most_the_median(tmp_path):
    cfg = _config(tmp_path)
    capped_cfg = type(cfg)(**{**cfg.__dict__, "closed_form": type(cfg.closed_form)()})
    assert capped_cfg.closed_form.count_cap == 1.0  # the default
    m = RoundManager(config=capped_cfg, store=Store(capped_cfg.database), metrics=Metrics(),
                     clock=lambda: 0.0)  # fmt: skip
    data = devices(3, count=4)
    x3, y3 = data[3]
    loud = (np.repeat(x3, 100, axis=0), np.repeat(y3, 100))  # the same data, 100 times over
    parts = []
    for i, (x, y) in enumerate([*data[:3], loud]):
        u = update_of(x, y, f"d{i}", method="lda")
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
        parts.append(cf.device_statistics(x, y, C))
    assert m.poll() is not None
    caps = cf.count_caps(np.stack([p.counts for p in parts]), 1.0)
    assert (parts[3].counts > caps).any()
    # Every device counted at most at the cap (these honest ones differ up to eightfold).
    want = LDA().solve_statistics(cf.merge([cf.capped(p, caps) for p in parts]))
    assert isinstance(m.tally, RunningStatistics)
    got = m.tally.solved
    assert got is not None and got.global_prototypes.shape == (C, K)
    np.testing.assert_allclose(got.global_prototypes, want.global_prototypes, rtol=1e-10)
    m.store.close()


def test_a_capped_fedcof_device_keeps_its_means():
    # FedCOF's statistics are counts, sums and per-class n mu mu^T: all scale with w_c.
    part = cf.means_statistics([4.0, 1.0], [[0.5, 0.0], [0.0, 1.0]])
    out = cf.capped(part, np.array([2.0, np.inf]))
    np.testing.assert_allclose(out.counts, [2.0, 1.0])
    np.testing.assert_allclose(out.sums, [[1.0, 0.0], [0.0, 1.0]])
    assert out.scatter is not None
    np.testing.assert_allclose(out.scatter[0], [[0.5, 0.0], [0.0, 0.0]])  # 2 * mu mu^T
    np.testing.assert_allclose(out.scatter[1], [[0.0, 0.0], [0.0, 1.0]])
