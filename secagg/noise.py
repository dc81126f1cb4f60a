"""The discrete Gaussian, sampled exactly, and each device's share of the fleet's noise.

``N_Z(0, sigma^2)`` puts mass proportional to ``exp(-x^2 / (2 sigma^2))`` on each integer
``x``. It is sampled here as in Canonne, Kamath and Steinke, "The Discrete Gaussian for
Differential Privacy" (NeurIPS 2020): Bernoulli(exp(-gamma)) by alternating series
(their Algorithm 1), the discrete Laplace by a uniform and a geometric (Algorithm 2), and
the discrete Gaussian by rejection from a discrete Laplace of scale
``floor(sigma) + 1`` (Algorithm 3). Every step is integer or :class:`~fractions.Fraction`
arithmetic on uniform integers, so there is no floating-point bias for an attacker to
exploit; ``sigma^2`` must be rational (a float is accepted as the rational it exactly is).
The paper's text is not in ``/work/shared/papers``: the algorithms here follow its
published pseudocode as recalled, and the tests check the distributions they produce
against the probability mass function computed directly.

Distributed noise (Kairouz, Liu and Steinke, "The Distributed Discrete Gaussian Mechanism
for Federated Learning with Secure Aggregation", ICML 2021; text likewise absent): the
server only ever sees a sum, so each device adds its part of the noise to its quantised
input before masking. With a target parameter ``sigma^2`` (in quantisation units) and a
fleet threshold ``t`` (the fewest survivors secure aggregation accepts), each device
samples ``N_Z(0, sigma^2 / t)``: any ``s >= t`` survivors' noises add to a sum of ``s``
independent discrete Gaussians whose parameters total ``s sigma^2 / t >= sigma^2``.

Caveat: a sum of discrete Gaussians is not itself a discrete Gaussian (unlike continuous
ones), and a discrete Gaussian's variance is slightly below its parameter
(:func:`variance`). Kairouz et al. bound how far the sum of ``n`` draws of
``N_Z(0, sigma^2)`` is from ``N_Z(0, n sigma^2)`` by a term that vanishes like
``exp(-2 pi^2 sigma^2 k / (k + 1))`` summed over ``k < n``, so it is negligible once each
device's ``sigma`` is a few units; the privacy accountant must take that term, with its
constant, from the paper itself, which this module does not attempt.
"""

from __future__ import annotations

import math
import secrets
from fractions import Fraction
from random import Random

import numpy as np

_SECRET_RNG = secrets.SystemRandom()
Rational = int | Fraction | float


def bernoulli(p: Fraction, rng: Random) -> bool:
    """True with probability ``p`` exactly (``0 <= p <= 1``)."""
    if not 0 <= p <= 1:
        raise ValueError(f"probability {p} is not in [0, 1]")
    return rng.randrange(p.denominator) < p.numerator


def bernoulli_exp(gamma: Fraction, rng: Random) -> bool:
    """True with probability ``exp(-gamma)`` exactly (``gamma >= 0``; CKS Algorithm 1).

    For ``gamma <= 1``: draw ``A_k ~ Bernoulli(gamma / k)`` for ``k = 1, 2, ...`` until one
    is 0 and answer whether that ``k`` is odd; ``P(stop at k) = gamma^(k-1)/(k-1)! -
    gamma^k/k!``, whose sum over odd ``k`` is the series of ``exp(-gamma)``. Larger
    ``gamma`` is a draw at 1 per whole unit and one at what remains."""
    if gamma < 0:
        raise ValueError(f"exp(-gamma) needs gamma >= 0, not {gamma}")
    return _bernoulli_exp(gamma.numerator, gamma.denominator, rng)


def discrete_laplace(scale: Fraction, rng: Random) -> int:
    """A draw with ``P(x) proportional to exp(-|x| / scale)`` on the integers (CKS
    Algorithm 2, with ``scale = t / s``).

    ``X = U + t V``, ``U`` uniform on ``0..t-1`` kept with probability ``exp(-U/t)`` and
    ``V`` geometric with ratio ``exp(-1)``, is geometric with ratio ``exp(-1/t)``;
    ``floor(X / s)`` is then geometric with ratio ``exp(-s/t)``. A random sign, with
    ``-0`` rejected so that 0 is not counted twice, makes it two-sided."""
    if scale <= 0:
        raise ValueError(f"discrete Laplace scale {scale} must be positive")
    return _discrete_laplace(scale.numerator, scale.denominator, rng)


def discrete_gaussian(sigma2: Rational, rng: Random | None = None) -> int:
    """One exact draw of ``N_Z(0, sigma2)`` (CKS Algorithm 3).

    Propose ``Y`` from the discrete Laplace of scale ``t = floor(sigma) + 1`` and accept it
    with probability ``exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2))``; the accepted ``Y`` has
    mass proportional to ``exp(-Y^2 / (2 sigma^2))``."""
    s2 = _rational(sigma2)
    source = _SECRET_RNG if rng is None else rng
    p, q = s2.numerator, s2.denominator
    # floor(sqrt(p/q)) = floor(isqrt(p q) / q), exact for integers p, q.
    t = math.isqrt(p * q) // q + 1
    # gamma = (|Y| - p/(q t))^2 / (2 p/q) = (|Y| q t - p)^2 / (2 p q t^2), kept as two
    # integers: Fraction arithmetic here made the sampler several times slower.
    den = 2 * p * q * t * t
    while True:
        y = _discrete_laplace(t, 1, source)
        if _bernoulli_exp((abs(y) * q * t - p) ** 2, den, source):
            return y


def _bernoulli_exp(num: int, den: int, rng: Random) -> bool:
    """``bernoulli_exp(num / den)`` on integers."""
    while num > den:
        if not _bernoulli_exp_unit(1, 1, rng):
            return False
        num -= den
    return _bernoulli_exp_unit(num, den, rng)


def _bernoulli_exp_unit(num: int, den: int, rng: Random) -> bool:
    """Algorithm 1's series for ``gamma = num / den <= 1``: ``A_k`` is 1 when a uniform
    draw on ``0..den*k - 1`` falls below ``num``."""
    k = 1
    while rng.randrange(den * k) < num:
        k += 1
    return k % 2 == 1


def _discrete_laplace(t: int, s: int, rng: Random) -> int:
    while True:
        u = rng.randrange(t)
        if not _bernoulli_exp(u, t, rng):
            continue
        v = 0
        while _bernoulli_exp_unit(1, 1, rng):
            v += 1
        y = (u + t * v) // s
        negative = rng.randrange(2) == 1
        if negative and y == 0:
            continue
        return -y if negative else y


def device_sigma2(sigma2: Rational, *, threshold: int) -> Fraction:
    """Each device's parameter, ``sigma^2 / t``, so that any ``t`` or more survivors'
    noises sum to parameters totalling at least ``sigma^2``."""
    if threshold < 1:
        raise ValueError(f"threshold {threshold} must be at least 1")
    return _rational(sigma2) / threshold


def device_noise(
    length: int, *, sigma2: Rational, threshold: int, rng: Random | None = None
) -> np.ndarray:
    """One device's share of the fleet's noise: ``length`` independent draws of
    ``N_Z(0, sigma2 / threshold)`` as int64, to add to its quantised input (same units)
    before it goes into the ring."""
    if length < 0:
        raise ValueError(f"noise length {length} is negative")
    share = device_sigma2(sigma2, threshold=threshold)
    source = _SECRET_RNG if rng is None else rng
    return np.array([discrete_gaussian(share, source) for _ in range(length)], dtype=np.int64)


def pmf(sigma2: Rational, support: np.ndarray) -> np.ndarray:
    """``P(X = x)`` of ``N_Z(0, sigma2)`` for each integer ``x`` of ``support``, normalised
    over every integer within ``12 sigma + 2`` of 0 (the rest weighs under ``e^-72``)."""
    s2 = float(_rational(sigma2))
    reach = int(12 * math.sqrt(s2)) + 2
    xs = np.arange(-reach, reach + 1, dtype=np.float64)
    norm = np.exp(-(xs**2) / (2 * s2)).sum()
    x = np.asarray(support, dtype=np.float64)
    return np.exp(-(x**2) / (2 * s2)) / norm


def variance(sigma2: Rational) -> float:
    """The variance of ``N_Z(0, sigma2)``, summed over its bulk; always below ``sigma2``
    (noticeably only for ``sigma2`` below about 1)."""
    reach = int(12 * math.sqrt(float(_rational(sigma2)))) + 2
    xs = np.arange(-reach, reach + 1)
    return float((pmf(sigma2, xs) * xs.astype(np.float64) ** 2).sum())


def _rational(value: Rational) -> Fraction:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"sigma^2 {value} is not finite")
    exact = Fraction(value)
    if exact <= 0:
        raise ValueError(f"sigma^2 {value} must be positive")
    return exact
