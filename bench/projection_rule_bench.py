"""Derive the public rule's ratio (secagg/dimension.py) on synthetic data (issue 52).

Ten Gaussian classes in :data:`FEATURES` dimensions (means of norm :data:`SEPARATION`,
a shared covariance of eigenvalues falling as ``i^-DECAY``, randomly rotated), so that
the exact head gains from every doubling of ``k`` up to 256, as features do. For each
fleet of :data:`DEVICES` devices of :data:`ROWS` rows and each epsilon of
:data:`EPSILONS`, every ``k`` of ``secagg.dimension.GRID``: the fleet's statistics
through the public projection (closed_form.projection: unit rows, projected, unit again),
a Gaussian of the secure plan's standard deviation on every summed coordinate (``T``
nine tenths of the fleet, ``c`` a tenth of ``T``), and the head the coordinator solves
(lda with the noise floor), scored on 20,000 test rows; the mean of :data:`DRAWS` draws.
Seeded throughout: this is a derivation on public, made-up data, not a release.

Both projections a fleet may run are tried: the random one, and the public whitening basis
(closed_form/basis.py) made from rows of another synthetic task (other class means, the
same feature geometry: what rendered source images through the backbone are to the
fleet's data). Each gets its ratio: of the ratios ``2^(-j/2)`` (j = 0..16), the one whose
rule (the largest ``k`` with ``r(k) >= ratio``) loses the least accuracy against each
setting's best ``k``, on average (one ratio for both lost up to 14.5 points on the random
projection). Keys: ``privacy.public_rule_ratio`` (the random projection's derived ratio),
``privacy.public_rule_code_ratio`` (``secagg.dimension.RATIO``: the two must agree),
``privacy.public_rule_mean_regret`` and ``_max_regret`` (accuracy lost, fractions), and
per setting ``privacy.public_rule_synthetic_<devices>_eps<e>_{best_k,rule_k,regret}``
(``eps0p5`` for 0.5); the same with ``public_rule_basis_`` and ``synthetic_basis_`` for the
basis (``secagg.dimension.BASIS_RATIO``).
"""

from __future__ import annotations

import sys

import numpy as np

import closed_form as cf
from closed_form.basis import public_basis
from closed_form.projection import prepare, projection
from secagg.dimension import BASIS_RATIO, GRID, RATIO, public_dim, sum_sigma

FEATURES, CLASSES, ROWS = 896, 10, 20
SEPARATION, DECAY = 0.4, 0.3
DEVICES = (30, 100, 300, 1000, 3000)
EPSILONS = (0.5, 1.0, 2.0, 8.0)
DRAWS = 2
DELTA, SCALE = 1e-5, 2.0**15
RATIOS = tuple(2.0 ** (-j / 2) for j in range(17))


def _plan(devices: int) -> tuple[int, int]:
    quorum = max(2, int(0.9 * devices))
    return quorum, quorum // 10


class _Classes:
    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        self.means = rng.normal(0.0, SEPARATION / np.sqrt(FEATURES), (CLASSES, FEATURES))
        spread = np.arange(1, FEATURES + 1) ** -DECAY
        self.scale = np.sqrt(spread / spread.sum())
        self.rotation = np.linalg.qr(rng.normal(size=(FEATURES, FEATURES)))[0]

    def draw(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        y = rng.integers(0, CLASSES, n)
        return self.means[y] + (rng.normal(size=(n, FEATURES)) * self.scale) @ self.rotation, y

    def public(self, n: int, seed: int) -> np.ndarray:
        """Unlabelled rows of another task: its own class means, the same geometry."""
        rng = np.random.default_rng(seed)
        means = rng.normal(0.0, SEPARATION / np.sqrt(FEATURES), (CLASSES, FEATURES))
        y = rng.integers(0, CLASSES, n)
        return means[y] + (rng.normal(size=(n, FEATURES)) * self.scale) @ self.rotation


def _accuracies(classes: _Classes, devices: int, x_test: np.ndarray, y_test: np.ndarray,
                basis: np.ndarray | None) -> dict[tuple[int, float], float]:  # fmt: skip
    x, y = classes.draw(devices * ROWS, seed=3)
    quorum, colluding = _plan(devices)
    out = {}
    for k in GRID:
        q = projection("synthetic", FEATURES, k, basis=basis)
        rows, test = prepare(x, q), prepare(x_test, q)
        gram, sums = rows.T @ rows, np.zeros((CLASSES, k))
        np.add.at(sums, y, rows)
        counts = np.bincount(y, minlength=CLASSES).astype(np.float64)
        for eps in EPSILONS:
            sigma = sum_sigma(k, devices=devices, classes=CLASSES, epsilon=eps, delta=DELTA,
                              scale=SCALE, quorum=quorum, colluding=colluding)  # fmt: skip
            rng = np.random.default_rng([devices, k, int(eps * 1000)])
            scores = []
            for _ in range(DRAWS):
                tri = cf.upper_triangle(gram) + rng.normal(0.0, sigma, cf.triangle_size(k))
                stats = cf.Statistics(
                    counts=counts + rng.normal(0.0, sigma, CLASSES),
                    sums=sums + rng.normal(0.0, sigma, sums.shape),
                    gram=cf.from_upper_triangle(tri), holders=np.ones(CLASSES, dtype=np.int64),
                    scatter=None, devices=devices,
                )  # fmt: skip
                head = cf.lda_head(cf.denoise(stats), noise_std=sigma)
                scores.append(float((head.predict(test) == y_test).mean()))
            out[(k, eps)] = float(np.mean(scores))
    return out


def _rule_k(devices: int, eps: float, ratio: float) -> int:  # the ratio given: any pipeline
    quorum, colluding = _plan(devices)
    return public_dim(devices=devices, dataset_size=ROWS, classes=CLASSES, epsilon=eps,
                      delta=DELTA, scale=SCALE, quorum=quorum, colluding=colluding,
                      below=FEATURES, ratio=ratio)  # fmt: skip


def run() -> dict[str, float]:
    classes = _Classes()
    x_test, y_test = classes.draw(20_000, seed=2)
    bases = {"random": None, "basis": public_basis(classes.public(9_000, seed=5))}
    table = {}
    for name, basis in bases.items():
        for devices in DEVICES:
            table[name, devices] = _accuracies(classes, devices, x_test, y_test, basis)
            print(f"  projection rule: {name}, {devices} devices done", file=sys.stderr,
                  flush=True)  # fmt: skip

    out: dict[str, float] = {}
    for b, code in (("random", RATIO), ("basis", BASIS_RATIO)):

        def regrets(ratio: float, b: str = b) -> dict[tuple[int, float], float]:
            return {(n, e): max(table[b, n][(k, e)] for k in GRID)
                    - table[b, n][(_rule_k(n, e, ratio), e)]
                    for n in DEVICES for e in EPSILONS}  # fmt: skip

        derived = min(RATIOS, key=lambda r: (float(np.mean(list(regrets(r).values()))), -r))
        chosen = regrets(derived)
        head = "privacy.public_rule_" + ("" if b == "random" else "basis_")
        out |= {
            f"{head}ratio": derived,
            f"{head}code_ratio": code,
            f"{head}mean_regret": float(np.mean(list(chosen.values()))),
            f"{head}max_regret": max(chosen.values()),
        }
        for (n, e), regret in chosen.items():
            tag = "" if b == "random" else "basis_"
            name = f"privacy.public_rule_synthetic_{tag}{n}_eps" + f"{e:g}".replace(".", "p")
            out[f"{name}_best_k"] = float(max(GRID, key=lambda k: table[b, n][(k, e)]))
            out[f"{name}_rule_k"] = float(_rule_k(n, e, derived))
            out[f"{name}_regret"] = regret
    return out


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key} = {value:.4g}")
