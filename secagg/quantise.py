"""Fixed-point encoding of float vectors into the ring ``Z_{2^k}`` the masks live in.

A device clips each coordinate to the public bound ``[-clip, clip]``, multiplies by the
public ``scale``, rounds to an integer and maps it into the ring by two's complement
(``-1`` is ``2^k - 1``). The ring sum of ``n`` devices, read back as a signed integer and
divided by ``scale``, is the sum of their clipped inputs as long as the true integer sum
stays in ``[-2^(k-1), 2^(k-1) - 1]``: :func:`max_devices` gives the largest ``n`` for
which that holds, with room left for the distributed noise.

Rounding is stochastic: ``y`` becomes ``floor(y) + 1`` with probability ``y - floor(y)``,
else ``floor(y)``. It is unbiased, so the rounding errors of many devices average out
(mean 0, variance at most ``n / 4`` units) instead of adding up to a bias, as
round-to-nearest can when devices hold similar values. The price is a worst case of just
under one unit per device rather than half a unit: :func:`sum_error_bound`. The coins come
from the operating system's secret source unless a test injects a seeded one.

Choose ``scale`` as a power of two: then scaling and decoding are exact in float64.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from random import Random

import numpy as np

from secagg.masks import Bits, ring_dtype

_SECRET_RNG = secrets.SystemRandom()
# Scaled values must be integers float64 holds exactly, so floor() and the sum are exact.
_FLOAT_EXACT = 2.0**52


@dataclass(frozen=True, kw_only=True)
class QuantiseSpec:
    """The fleet's public encoding: per-coordinate bound, scale and ring width."""

    clip: float
    scale: float
    bits: Bits = 64

    def __post_init__(self) -> None:
        ring_dtype(self.bits)
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip bound {self.clip} must be positive and finite")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale {self.scale} must be positive and finite")
        if self.unit_bound >= min(_FLOAT_EXACT, 2.0 ** (self.bits - 1)):
            raise ValueError(
                f"clip * scale = {self.clip * self.scale} leaves no room in a {self.bits}-bit ring"
            )

    @property
    def unit_bound(self) -> int:
        """The largest ``|q|`` one device can send: ``ceil(clip * scale)``."""
        return math.ceil(self.clip * self.scale)


def stochastic_round(y: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``floor(y) + [u < y - floor(y)]`` as int64, with ``u`` uniform on ``[0, 1)``."""
    low = np.floor(y)
    return (low + (u < y - low)).astype(np.int64)


def uniforms(size: int, rng: Random) -> np.ndarray:
    """``size`` uniforms on ``[0, 1)`` on the 2^-53 grid, from ``rng``'s bytes."""
    words = np.frombuffer(rng.randbytes(8 * size), dtype="<u8")
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53


def round_scaled(x: np.ndarray, *, spec: QuantiseSpec, rng: Random | None = None) -> np.ndarray:
    """The integers a device sends before masking: clip, scale, round stochastically."""
    values = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError("cannot quantise NaN or infinite values")
    y = np.clip(values, -spec.clip, spec.clip) * spec.scale
    source = _SECRET_RNG if rng is None else rng
    return stochastic_round(y, uniforms(y.size, source).reshape(y.shape))


def to_ring(q: np.ndarray, *, bits: Bits) -> np.ndarray:
    """Signed integers into ``Z_{2^bits}`` by two's complement.

    The int64 -> uint64 cast keeps the bit pattern (``-1`` becomes ``2^64 - 1``), and
    narrowing to uint32 keeps the low 32 bits, which is reduction mod ``2^32``."""
    q = np.asarray(q)
    if q.dtype != np.int64:
        raise TypeError(f"ring inputs are int64, not {q.dtype}")
    return q.astype(np.uint64).astype(ring_dtype(bits))


def from_ring(r: np.ndarray) -> np.ndarray:
    """Ring elements back to signed integers in ``[-2^(k-1), 2^(k-1) - 1]`` (int64)."""
    if r.dtype == ring_dtype(32):
        return r.view(np.int32).astype(np.int64)
    if r.dtype == ring_dtype(64):
        return r.view(np.int64).copy()
    raise TypeError(f"{r.dtype} is not a ring dtype (uint32 or uint64)")


def encode(x: np.ndarray, *, spec: QuantiseSpec, rng: Random | None = None) -> np.ndarray:
    """One device's float vector as ring elements, ready for masking."""
    return to_ring(round_scaled(x, spec=spec, rng=rng), bits=spec.bits)


def decode(total: np.ndarray, *, spec: QuantiseSpec) -> np.ndarray:
    """The float sum from the unmasked ring sum (float64)."""
    if total.dtype != ring_dtype(spec.bits):
        raise TypeError(f"a {spec.bits}-bit sum must be {ring_dtype(spec.bits)}, not {total.dtype}")
    return from_ring(total).astype(np.float64) / spec.scale


def sum_error_bound(n: int, *, spec: QuantiseSpec) -> float:
    """Per coordinate, ``|decode(sum) - sum of the clipped inputs| < n / scale`` for ``n``
    devices without wrap-around: each stochastic rounding moves a value by less than one
    unit. (Its typical size is far smaller: standard deviation at most
    ``sqrt(n) / (2 scale)``.)"""
    if n < 0:
        raise ValueError(f"device count {n} is negative")
    return n / spec.scale


def max_devices(*, spec: QuantiseSpec, headroom: int = 0) -> int:
    """The largest ``n`` whose sum cannot wrap: ``n * ceil(clip * scale) + headroom <=
    2^(k-1) - 1``. ``headroom`` is the integer bound reserved for the summed noise (for a
    discrete Gaussian of parameter ``sigma^2`` in units, some ``m * sigma``; the caller
    picks ``m`` for the tail probability it accepts)."""
    if headroom < 0:
        raise ValueError(f"headroom {headroom} is negative")
    room = (1 << (spec.bits - 1)) - 1 - headroom
    return max(0, room // spec.unit_bound)
