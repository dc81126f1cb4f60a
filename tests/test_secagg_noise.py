"""The exact discrete Gaussian sampler and the distributed noise split: hand traces of the
Bernoulli(exp(-gamma)) series, the mass function by hand, and seeded statistical checks
whose tolerances (five standard errors) a wrong distribution cannot meet."""

import math
import random
from fractions import Fraction

import numpy as np
import pytest

from secagg.noise import (
    bernoulli,
    bernoulli_exp,
    device_noise,
    device_sigma2,
    discrete_gaussian,
    discrete_laplace,
    pmf,
    variance,
)


class Scripted(random.Random):
    """Answers randrange from a script, recording the bounds it was asked for."""

    def __init__(self, values: list[int]) -> None:
        super().__init__(0)
        self.values = list(values)
        self.asked: list[int] = []

    def randrange(self, stop, *args, **kwargs) -> int:  # type: ignore[override]
        self.asked.append(stop)
        return self.values.pop(0)


def within(sample: np.ndarray, mean: float, var: float, *, sds: float = 5.0) -> bool:
    """Whether ``sample``'s mean is within ``sds`` standard errors of ``mean``."""
    return abs(float(sample.mean()) - mean) < sds * math.sqrt(var / sample.size)


def test_bernoulli_exp_series_traced_by_hand() -> None:
    # gamma = 1/2: A_1 ~ Bernoulli(1/2) is randrange(2) < 1; A_2 ~ Bernoulli(1/4) is
    # randrange(4) < 1. Script 0 then 3: A_1 = 1, A_2 = 0, stop at k = 2 (even): False.
    rng = Scripted([0, 3])
    assert bernoulli_exp(Fraction(1, 2), rng) is False
    assert rng.asked == [2, 4]
    # Script 1: A_1 = 0, stop at k = 1 (odd): True.
    assert bernoulli_exp(Fraction(1, 2), Scripted([1])) is True
    # gamma = 3/2 is a draw at 1 then one at 1/2. At 1: randrange(1) = 0 < 1 so A_1 = 1,
    # then randrange(2) = 1 so A_2 = 0, k = 2: that draw fails and so does the whole.
    rng = Scripted([0, 1])
    assert bernoulli_exp(Fraction(3, 2), rng) is False
    assert rng.asked == [1, 2]


def test_bernoulli_exp_of_zero_is_certain() -> None:
    rng = random.Random(0)
    assert all(bernoulli_exp(Fraction(0), rng) for _ in range(200))


@pytest.mark.parametrize("gamma", [Fraction(1, 2), Fraction(5, 2)])
def test_bernoulli_exp_frequency(gamma: Fraction) -> None:
    rng = random.Random(1)
    hits = np.array([bernoulli_exp(gamma, rng) for _ in range(20_000)], dtype=np.float64)
    p = math.exp(-gamma)
    assert within(hits, p, p * (1 - p))
    # The neighbouring gammas are far outside those bounds: 0.6065 vs 0.5 and 0.0821 vs 0.05.


def test_bernoulli_is_exact_on_the_denominator() -> None:
    # Bernoulli(2/5): true exactly for randrange(5) in {0, 1}.
    assert [bernoulli(Fraction(2, 5), Scripted([v])) for v in range(5)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    with pytest.raises(ValueError):
        bernoulli(Fraction(3, 2), random.Random(0))


def test_discrete_laplace_matches_its_mass_function() -> None:
    # P(x) = (1 - q) / (1 + q) * q^|x| with q = e^(-1/scale); variance 2q / (1 - q)^2.
    rng = random.Random(2)
    draws = np.array([discrete_laplace(Fraction(3, 2), rng) for _ in range(20_000)])
    q = math.exp(-2 / 3)
    var = 2 * q / (1 - q) ** 2
    assert within(draws, 0.0, var)
    p0 = (1 - q) / (1 + q)
    assert within((draws == 0).astype(float), p0, p0 * (1 - p0))
    fourth = sum(x**4 * (1 - q) / (1 + q) * q ** abs(x) for x in range(-200, 201))
    assert within(draws.astype(float) ** 2, var, fourth - var**2)


def test_pmf_and_variance_by_hand() -> None:
    # sigma^2 = 1: P(0) = 1 / sum_x e^(-x^2/2) = 1 / (1 + 2(e^-0.5 + e^-2 + e^-4.5 + ...)).
    norm = 1 + 2 * sum(math.exp(-(x**2) / 2) for x in range(1, 30))
    assert pmf(1, np.array([0]))[0] == pytest.approx(1 / norm, rel=1e-12)
    assert pmf(1, np.array([2]))[0] == pytest.approx(math.exp(-2) / norm, rel=1e-12)
    # sigma^2 = 1/4: variance 2(e^-2 + 4e^-8 + 9e^-18) / (1 + 2(e^-2 + e^-8 + e^-18)), about
    # 0.2150, visibly below the parameter; at sigma^2 = 4 the gap is below 1e-12.
    num = 2 * sum(x**2 * math.exp(-2 * x**2) for x in range(1, 10))
    den = 1 + 2 * sum(math.exp(-2 * x**2) for x in range(1, 10))
    assert variance(Fraction(1, 4)) == pytest.approx(num / den, rel=1e-12)
    assert 0.214 < variance(Fraction(1, 4)) < 0.216
    assert variance(4) == pytest.approx(4, abs=1e-12)


@pytest.mark.parametrize("sigma2", [4, Fraction(9, 4), 0.5])
def test_discrete_gaussian_mean_variance_and_zero_mass(sigma2) -> None:
    rng = random.Random(4)
    draws = np.array([discrete_gaussian(sigma2, rng) for _ in range(20_000)])
    var = variance(sigma2)
    support = np.arange(-60, 61)
    fourth = float((pmf(sigma2, support) * support.astype(float) ** 4).sum())
    assert within(draws, 0.0, var)
    assert within(draws.astype(float) ** 2, var, fourth - var**2)
    p0 = float(pmf(sigma2, np.array([0]))[0])
    assert within((draws == 0).astype(float), p0, p0 * (1 - p0))
    # Symmetric: as many draws at +1 as at -1, within five standard errors of the difference.
    p1 = float(pmf(sigma2, np.array([1]))[0])
    diff = (draws == 1).astype(float) - (draws == -1).astype(float)
    assert within(diff, 0.0, 2 * p1)


def test_device_share_of_the_noise() -> None:
    assert device_sigma2(4, threshold=3) == Fraction(4, 3)
    assert device_sigma2(Fraction(1, 2), threshold=2) == Fraction(1, 4)
    # Four survivors of threshold 4 at sigma^2 = 8: each adds N_Z(0, 2), the sum has
    # variance 4 * variance(2) (just under 8).
    rng = random.Random(5)
    total = sum(device_noise(5_000, sigma2=8, threshold=4, rng=rng) for _ in range(4))
    assert isinstance(total, np.ndarray) and total.dtype == np.int64 and total.shape == (5_000,)
    var = 4 * variance(2)
    assert var == pytest.approx(8, abs=1e-6)
    assert within(total, 0.0, var)
    # For S a sum of n i.i.d. centred draws, E S^4 = n m4 + 3n(n-1) v^2, so
    # Var(S^2) = 4 m4 + 36 v^2 - (4v)^2 = 4 m4 + 20 v^2 for n = 4.
    support = np.arange(-40, 41).astype(float)
    m4 = float((pmf(2, support) * support**4).sum())
    assert within(total.astype(float) ** 2, var, 4 * m4 + 20 * variance(2) ** 2)


def test_the_default_source_is_the_secret_one() -> None:
    draws = {discrete_gaussian(100) for _ in range(50)}
    assert len(draws) > 5


def test_bad_parameters_are_refused() -> None:
    for bad in (0, -1, Fraction(-1, 2), float("nan"), float("inf")):
        with pytest.raises(ValueError):
            discrete_gaussian(bad, random.Random(0))
    with pytest.raises(ValueError, match="threshold"):
        device_sigma2(4, threshold=0)
    with pytest.raises(ValueError, match="negative"):
        device_noise(-1, sigma2=4, threshold=2)
    with pytest.raises(ValueError, match="gamma"):
        bernoulli_exp(Fraction(-1), random.Random(0))
    with pytest.raises(ValueError, match="scale"):
        discrete_laplace(Fraction(0), random.Random(0))
