"""The fleet's secure sum of closed-form statistics, simulated: what the coordinator of a
secure fleet unmasks, formed without running the protocol (``--transport vector
--secure-aggregation``, and bench/secagg_bench.py at 1,000 devices).

Each device's input is what :meth:`secagg.device.SecAggDevice.masked_input`
encodes before it masks: its flattened statistics (``secagg.fleet.flatten``)
clipped, scaled and stochastically rounded (``secagg.quantise.round_scaled``),
plus its share ``N_Z(0, sigma^2 / t)`` of the distributed noise, mapped into the ring.
The masks are left out: the pairwise masks cancel and the self masks are removed exactly
in the ring, which tests/test_secagg_protocol.py checks on the real state machines. The
decoded ring sum is then what the round hands the coordinator.

The noise comes from :func:`discrete_gaussian`, a vectorised numpy sampler of the same
discrete Gaussian (Canonne, Kamath and Steinke's Algorithm 3 in floating point): a
device's exact sampler (``secagg.noise``) draws about 36,000 values a second on
the development machine, and one k-512 sum of 1,000 devices needs 136 million. It is for
simulation only: its floating-point acceptance test is not the hardened sampler a device
runs.
"""

from __future__ import annotations

import math
from random import Random

import numpy as np

from secagg.masks import ring_add
from secagg.quantise import QuantiseSpec, decode, round_scaled, to_ring


def discrete_gaussian(size: int, sigma2: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of ``N_Z(0, sigma2)`` (int64): a discrete Laplace of scale
    ``s = floor(sigma) + 1`` (the difference of two geometric counts of ratio
    ``exp(-1/s)``), kept with probability ``exp(-(|y| - sigma2/s)^2 / (2 sigma2))``,
    CKS Algorithm 3 as ``secagg.noise.discrete_gaussian`` runs it exactly."""
    if not (math.isfinite(sigma2) and sigma2 > 0):
        raise ValueError(f"sigma2 must be positive and finite, got {sigma2}")
    s = math.floor(math.sqrt(sigma2)) + 1
    p = -math.expm1(-1.0 / s)
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        y = rng.geometric(p, todo.size) - rng.geometric(p, todo.size)
        keep = rng.random(todo.size) < np.exp(-((np.abs(y) - sigma2 / s) ** 2) / (2 * sigma2))
        out[todo[keep]] = y[keep]
        todo = todo[~keep]
    return out


class SimulatedSecureSum:
    """The ring sum of the devices' quantised, noised inputs, as the coordinator unmasks
    it. ``share_sigma2``: each device's noise parameter in units^2 (``sigma^2 / t``, the
    plan's ``share_sigma2``), None without noise."""

    def __init__(self, *, spec: QuantiseSpec, share_sigma2: float | None) -> None:
        self.spec = spec
        self.share_sigma2 = share_sigma2
        self.devices = 0
        self._total: np.ndarray | None = None

    def add(self, vector: np.ndarray, *, coins: Random | None, noise: np.random.Generator) -> None:
        """One device's input. ``coins``: its stochastic rounding's (None: the operating
        system's secret source, as on a device); ``noise``: the generator of its share."""
        q = round_scaled(vector, spec=self.spec, rng=coins)
        if self.share_sigma2 is not None:
            q = q + discrete_gaussian(q.size, self.share_sigma2, noise)
        ring = to_ring(q, bits=self.spec.bits)
        self._total = ring if self._total is None else ring_add(self._total, ring)
        self.devices += 1

    def decoded(self) -> np.ndarray:
        """The float sum the coordinator decodes (float64)."""
        if self._total is None:
            raise ValueError("no device has added its input")
        return decode(self._total, spec=self.spec)
