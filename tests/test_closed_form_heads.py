"""Closed-form heads from summed class statistics: LDA by hand, heads of merged statistics
equal to the pooled heads, FedCOF's covariance from the spread of the means, OAS."""

import math

import numpy as np
import pytest

from closed_form.arrays import noise_floor, psd
from closed_form.heads import (
    LinearHead,
    fedcof_covariances,
    fedcof_gram,
    fedcof_head,
    lda_head,
    oas_shrinkage,
    ridge_head,
)
from closed_form.statistics import (
    Statistics,
    clip_rows,
    device_statistics,
    means_statistics,
    merge,
)


def assert_heads_equal(got: LinearHead, want: LinearHead, rtol: float = 1e-8) -> None:
    np.testing.assert_array_equal(got.present, want.present)
    for a, b in ((got.weight, want.weight), (got.bias, want.bias)):
        atol = 1e-12 * max(1.0, float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- LDA by hand


@pytest.mark.parametrize(
    "x, labels, shrinkage, weight, bias",
    [
        # 1-D: class 0 at .1, .3 (mu .2), class 1 at .6, .8, 1 (mu .8); within scatter
        # .01 + .01 + .04 + 0 + .04 = .1, Sigma = .1 / (5 - 2) = 1/30; w_c = 30 mu_c;
        # b_c = -mu_c w_c / 2 + log(N_c / 5).
        (
            [[0.1], [0.3], [0.6], [0.8], [1.0]],
            [0, 0, 1, 1, 1],
            0.0,
            [[6.0], [24.0]],
            [-0.6 + math.log(0.4), -9.6 + math.log(0.6)],
        ),
        # 2-D, Sigma isotropic (deviations (+-.1, +-.1) in class 0, (+-.1, -+.1) in class 1:
        # W = .04 I, Sigma = .02 I), so any shrinkage gives the same head: w_c = mu_c / .02,
        # mu_0 = (.2, .1), mu_1 = (.6, .3); b_0 = -(.2*10 + .1*5)/2, b_1 = -(.6*30 + .3*15)/2.
        (
            [[0.1, 0.0], [0.3, 0.2], [0.5, 0.4], [0.7, 0.2]],
            [0, 0, 1, 1],
            None,
            [[10.0, 5.0], [30.0, 15.0]],
            [-1.25 + math.log(0.5), -11.25 + math.log(0.5)],
        ),
        # 2-D, Sigma = diag(.02, 0) (no spread along the second axis), tr/k = .01; shrinkage
        # .5 gives diag(.015, .005); mu_0 = (.2, 0), mu_1 = (.6, .1): w_0 = (40/3, 0),
        # w_1 = (40, 20); b_0 = -(.2 * 40/3)/2 = -4/3, b_1 = -(24 + 2)/2 = -13.
        (
            [[0.1, 0.0], [0.3, 0.0], [0.5, 0.1], [0.7, 0.1]],
            [0, 0, 1, 1],
            0.5,
            [[40.0 / 3.0, 0.0], [40.0, 20.0]],
            [-4.0 / 3.0 + math.log(0.5), -13.0 + math.log(0.5)],
        ),
    ],
)
def test_lda_head_matches_hand_computation(
    x: list[list[float]],
    labels: list[int],
    shrinkage: float | None,
    weight: list[list[float]],
    bias: list[float],
) -> None:
    head = lda_head(device_statistics(np.array(x), np.array(labels), 2), shrinkage=shrinkage)
    np.testing.assert_allclose(head.weight, weight, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(head.bias, bias, rtol=1e-9)


def test_lda_1d_boundary_sits_where_the_log_odds_cross() -> None:
    head = lda_head(
        device_statistics(
            np.array([[0.1], [0.3], [0.6], [0.8], [1.0]]), np.array([0, 0, 1, 1, 1]), 2
        ),
        shrinkage=0.0,
    )
    # 6x - .6 + log .4 = 24x - 9.6 + log .6  <=>  x = .5 + log(2/3) / 18
    boundary = 0.5 + math.log(2.0 / 3.0) / 18.0
    assert head.predict(np.array([[boundary - 1e-6], [boundary + 1e-6]])).tolist() == [0, 1]


# --------------------------------------------------------------------------- pooling is exact

K, C = 12, 4
SIZES = (3, 40, 17, 60, 8)
HELD = ((0, 1), (0, 1, 2, 3), (2,), (1, 2, 3), (0, 3))


def _fleet(seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Five devices of clipped rows, uneven sizes, each lacking some classes."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(C, K)) * 0.5
    xs, ys = [], []
    for size, held in zip(SIZES, HELD, strict=True):
        y = rng.choice(np.array(held), size=size)
        y[: len(held)] = held  # every held class really held
        xs.append(clip_rows(centres[y] + rng.normal(size=(size, K)) * 0.4))
        ys.append(y)
    return xs, ys


def _groupings(rng: np.random.Generator, parts: list[Statistics]) -> Statistics:
    """Merge within random groups, then the groups in random order."""
    order = rng.permutation(len(parts))
    cuts = np.sort(rng.choice(np.arange(1, len(parts)), size=rng.integers(0, 4), replace=False))
    groups = [merge(parts[i] for i in chunk) for chunk in np.split(order, cuts)]
    return merge(groups[i] for i in rng.permutation(len(groups)))


def _means_part(stats: Statistics) -> Statistics:
    held = stats.counts > 0
    means = np.zeros_like(stats.sums)
    means[held] = stats.sums[held] / stats.counts[held, None]
    return means_statistics(stats.counts, means)


def test_merged_heads_equal_pooled_heads_for_any_grouping() -> None:
    xs, ys = _fleet(2)
    devices = [device_statistics(x, y, C) for x, y in zip(xs, ys, strict=True)]
    pooled = device_statistics(np.vstack(xs), np.concatenate(ys), C)
    fedcof_parts = [_means_part(d) for d in devices]
    fedcof_in_order = merge(fedcof_parts)
    rng = np.random.default_rng(3)
    for _ in range(6):
        merged = _groupings(rng, devices)
        assert merged.devices == 5
        assert merged.holders.tolist() == [3, 3, 3, 3]
        assert_heads_equal(lda_head(merged), lda_head(pooled))
        assert_heads_equal(lda_head(merged, shrinkage=0.2), lda_head(pooled, shrinkage=0.2))
        assert_heads_equal(ridge_head(merged, lam=0.05), ridge_head(pooled, lam=0.05))
        assert_heads_equal(fedcof_head(_groupings(rng, fedcof_parts)), fedcof_head(fedcof_in_order))


def _numpy_lda(x: np.ndarray, y: np.ndarray, shrinkage: float | None) -> LinearHead:
    """LDA straight from the rows: centred within-class covariance, no Gram matrix."""
    n, k = x.shape
    mus = np.stack([x[y == c].mean(axis=0) for c in range(C)])
    centred = x - mus[y]
    sigma = centred.T @ centred / (n - C)
    rho = oas_shrinkage(sigma, n) if shrinkage is None else shrinkage
    shrunk = (1 - rho) * sigma + rho * np.trace(sigma) / k * np.eye(k)
    weight = np.linalg.solve(shrunk, mus.T).T
    counts = np.bincount(y, minlength=C)
    bias = -0.5 * np.sum(mus * weight, axis=1) + np.log(counts / n)
    return LinearHead(weight=weight, bias=bias, present=np.ones(C, dtype=bool))


@pytest.mark.parametrize("shrinkage", [None, 0.0, 0.3])
def test_lda_from_statistics_equals_lda_from_raw_rows(shrinkage: float | None) -> None:
    xs, ys = _fleet(4)
    x, y = np.vstack(xs), np.concatenate(ys)
    head = lda_head(
        merge(device_statistics(a, b, C) for a, b in zip(xs, ys, strict=True)), shrinkage=shrinkage
    )
    assert_heads_equal(head, _numpy_lda(x, y, shrinkage))


def test_ridge_head_is_least_squares_on_one_hot_targets() -> None:
    xs, ys = _fleet(5)
    x, y = np.vstack(xs), np.concatenate(ys)
    targets = np.eye(C)[y]
    lam = 0.3
    want = np.linalg.solve(x.T @ x + lam * np.eye(K), x.T @ targets).T
    head = ridge_head(
        merge(device_statistics(a, b, C) for a, b in zip(xs, ys, strict=True)), lam=lam
    )
    np.testing.assert_allclose(head.weight, want, rtol=1e-8, atol=1e-12)
    assert not head.bias.any()


def test_heads_need_a_gram_and_a_present_class() -> None:
    fedcof_only = means_statistics(np.array([2.0, 1.0]), np.ones((2, 3)) * 0.1)
    with pytest.raises(ValueError, match="gram"):
        lda_head(fedcof_only)
    with pytest.raises(ValueError, match="gram"):
        ridge_head(fedcof_only)
    with pytest.raises(ValueError, match="scatter"):
        fedcof_gram(Statistics.empty(num_classes=2, dim=3))
    with pytest.raises(ValueError, match="no class"):
        ridge_head(Statistics.empty(num_classes=2, dim=3))


def test_a_class_nobody_holds_is_never_predicted() -> None:
    rng = np.random.default_rng(6)
    x = clip_rows(rng.normal(size=(30, 4)))
    stats = device_statistics(x, rng.choice(np.array([0, 2]), size=30), 3)
    for head in (lda_head(stats), ridge_head(stats)):
        assert head.present.tolist() == [True, False, True]
        assert np.isneginf(head.scores(x)[:, 1]).all()
        assert set(head.predict(rng.normal(size=(500, 4))).tolist()) <= {0, 2}


def test_linear_head_refuses_no_present_class_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match="present class"):
        LinearHead(weight=np.zeros((2, 3)), bias=np.zeros(2), present=np.zeros(2, dtype=bool))
    with pytest.raises(ValueError, match="bias has shape"):
        LinearHead(weight=np.zeros((2, 3)), bias=np.zeros(3), present=np.ones(2, dtype=bool))
    head = LinearHead(weight=np.zeros((2, 3)), bias=np.zeros(2), present=np.ones(2, dtype=bool))
    with pytest.raises(ValueError, match="features"):
        head.scores(np.zeros((1, 4)))


# --------------------------------------------------------------------------- FedCOF

FK, FC = 5, 3


def _gaussian_world(seed: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(FC, FK))
    centres *= 0.3 / np.linalg.norm(centres, axis=1, keepdims=True)
    a = rng.normal(size=(FK, FK))
    cov = a @ a.T
    cov *= 0.15**2 * FK / np.trace(cov)  # shared class covariance, rows mostly inside the ball
    return rng, centres, cov


def _draw(
    rng: np.random.Generator, centres: np.ndarray, cov: np.ndarray, y: np.ndarray
) -> np.ndarray:
    noise = rng.multivariate_normal(np.zeros(FK), cov, size=len(y))
    return clip_rows(centres[y] + noise)


def _federate(
    rng: np.random.Generator, centres: np.ndarray, cov: np.ndarray, devices: int, per_device: int
) -> tuple[Statistics, Statistics]:
    """Exact (Gram) and FedCOF (means only) statistics of the same devices' rows."""
    exact, means_only = [], []
    for _ in range(devices):
        held = rng.choice(FC, size=rng.integers(1, FC + 1), replace=False)
        y = rng.choice(held, size=per_device)
        stats = device_statistics(_draw(rng, centres, cov, y), y, FC)
        exact.append(stats)
        means_only.append(_means_part(stats))
    return merge(exact), merge(means_only)


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fedcof_with_many_devices_recovers_the_gram_and_the_accuracy() -> None:
    rng, centres, cov = _gaussian_world(0)
    exact, means_only = _federate(rng, centres, cov, devices=400, per_device=20)
    assert exact.gram is not None
    assert _relative(fedcof_gram(means_only), exact.gram) < 0.1
    for c, class_cov in enumerate(fedcof_covariances(means_only)):
        assert means_only.holders[c] > 200
        assert _relative(class_cov, cov) < 0.25
    y = rng.integers(0, FC, size=20_000)
    x = _draw(rng, centres, cov, y)
    ridge_acc = float(np.mean(ridge_head(exact).predict(x) == y))
    fedcof_acc = float(np.mean(fedcof_head(means_only).predict(x) == y))
    assert 0.6 < ridge_acc < 0.99  # a problem with room to be wrong
    assert abs(fedcof_acc - ridge_acc) < 0.02


def test_fedcof_with_two_devices_sees_one_direction_per_class() -> None:
    rng, centres, cov = _gaussian_world(0)
    exact, means_only = _federate(rng, centres, cov, devices=2, per_device=4000)
    assert exact.gram is not None
    for c, class_cov in enumerate(fedcof_covariances(means_only)):
        if means_only.holders[c] < 2:
            assert not class_cov.any()  # one device's mean says nothing of the spread
            continue
        # two means about their weighted average span one line: rank 1, up to the rounding
        # of scatter - N mu mu^T (a difference of two large, nearly equal matrices)
        eig = np.linalg.eigvalsh(class_cov)
        assert eig[-2:-1].max() < 1e-8 * eig[-1]
    assert _relative(fedcof_gram(means_only), exact.gram) > 0.3


def test_fedcof_by_hand() -> None:
    # 1-D. Class 0: device A holds 2 rows of mean .2, device B 2 rows of mean .6: mu = .4,
    # scatter = 2(.04) + 2(.36) = .8, N mu^2 = .64, Sigma_0 = (.8 - .64) / (2 - 1) = .16.
    # Class 1: device B alone, 3 rows of mean .5: Sigma_1 = 0.
    # G = (4 - 1)(.16) + .64 + 3(.25) = 1.87; ridge: w_c = s_c / (G + lam).
    a = means_statistics(np.array([2.0, 0.0]), np.array([[0.2], [0.0]]))
    b = means_statistics(np.array([2.0, 3.0]), np.array([[0.6], [0.5]]))
    stats = merge([a, b])
    assert stats.holders.tolist() == [2, 1]
    np.testing.assert_allclose(fedcof_covariances(stats)[:, 0, 0], [0.16, 0.0], atol=1e-15)
    np.testing.assert_allclose(fedcof_gram(stats), [[1.87]], rtol=1e-14)
    head = fedcof_head(stats, lam=0.1)
    np.testing.assert_allclose(head.weight, [[1.6 / 1.97], [1.5 / 1.97]], rtol=1e-14)


# --------------------------------------------------------------------------- OAS


@pytest.mark.parametrize("n, p, seed", [(50, 8, 0), (5, 12, 1), (400, 3, 2), (30, 30, 3)])
def test_oas_shrinkage_matches_scikit_learn(n: int, p: int, seed: int) -> None:
    covariance = pytest.importorskip("sklearn.covariance", reason="scikit-learn not installed")
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p)) @ rng.normal(size=(p, p))
    centred = x - x.mean(axis=0)
    emp = centred.T @ centred / n  # scikit-learn's empirical (biased) covariance
    _, want = covariance.oas(x)
    assert oas_shrinkage(emp, n) == pytest.approx(want, rel=1e-10)


def test_oas_shrinks_fully_toward_an_already_isotropic_covariance() -> None:
    assert oas_shrinkage(0.3 * np.eye(4), 100) == 1.0
    assert oas_shrinkage(np.zeros((3, 3)), 10) == 1.0
    assert oas_shrinkage(np.array([[2.0]]), 10) == 0.0
    rng = np.random.default_rng(7)
    a = rng.normal(size=(6, 6))
    rho = oas_shrinkage(a @ a.T, 1000)
    assert 0.0 < rho < 1.0


def test_a_noise_floor_raises_only_the_eigenvalues_below_it() -> None:
    # diag(4, 0.5, -1) in a rotated basis: floored at 1, its eigenvalues are (4, 1, 1).
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))
    m = q @ np.diag([4.0, 0.5, -1.0]) @ q.T
    np.testing.assert_allclose(np.linalg.eigvalsh(psd(m, floor=1.0)), [1.0, 1.0, 4.0])
    np.testing.assert_allclose(np.linalg.eigvalsh(psd(m)), [0.0, 0.5, 4.0], atol=1e-12)
    # The floor is three standard deviations of the noise on one direction's scatter.
    assert noise_floor(0.05) == pytest.approx(3 * math.sqrt(2) * 0.05)
    assert noise_floor(0.0) == 0.0
    with pytest.raises(ValueError, match="noise_std"):
        noise_floor(-1.0)
    rng = np.random.default_rng(1)
    v = rng.normal(size=8)
    v /= np.linalg.norm(v)
    draws = []
    for _ in range(4000):
        noise = rng.normal(scale=0.05, size=(8, 8))
        wigner = np.triu(noise) + np.triu(noise, 1).T  # symmetric, each entry of sd 0.05
        draws.append(v @ wigner @ v)
    assert np.std(draws) <= math.sqrt(2) * 0.05 * 1.05


def test_exact_statistics_solve_the_same_lda_without_a_noise_level() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 6)) * 0.1
    y = rng.integers(0, 3, size=200)
    x[np.arange(200), y] += 0.3
    stats = device_statistics(clip_rows(x), y, 3)
    plain, floored = lda_head(stats), lda_head(stats, noise_std=0.0)
    np.testing.assert_array_equal(plain.weight, floored.weight)
    # A noise level moves the head only where the scatter lies below it.
    tiny = lda_head(stats, noise_std=1e-9)
    np.testing.assert_allclose(tiny.weight, plain.weight, rtol=1e-6)
