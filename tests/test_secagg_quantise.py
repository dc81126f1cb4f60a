"""Fixed-point encoding into Z_{2^k}: stochastic rounding and two's complement by hand,
the decoded sum's error bound, and the device count at which the sum wraps."""

import random

import numpy as np
import pytest

from secagg.masks import Bits, ring_add
from secagg.quantise import (
    QuantiseSpec,
    decode,
    encode,
    from_ring,
    max_devices,
    round_scaled,
    stochastic_round,
    sum_error_bound,
    to_ring,
    uniforms,
)

U32 = 2**32


def test_stochastic_round_worked_by_hand() -> None:
    # clip 2, scale 4: x = [0.3, -0.3, 5.0, -1.126, 1.5] scales to y = [1.2, -1.2, 8.0
    # (5 clipped to 2), -4.504, 6.0]; floor(y) = [1, -2, 8, -5, 6], fractions
    # [0.2, 0.8, 0, 0.496, 0]. With u = [0.1, 0.9, 0.0, 0.5, 0.99]: up where u < fraction.
    y = np.array([1.2, -1.2, 8.0, -4.504, 6.0])
    u = np.array([0.1, 0.9, 0.0, 0.5, 0.99])
    assert stochastic_round(y, u).tolist() == [2, -2, 8, -5, 6]
    u = np.array([0.3, 0.7, 0.999, 0.4, 0.0])
    assert stochastic_round(y, u).tolist() == [1, -1, 8, -4, 6]


def test_round_scaled_clips_then_scales() -> None:
    spec = QuantiseSpec(clip=2.0, scale=4.0, bits=32)
    q = round_scaled(np.array([5.0, -7.0, 1.25, -0.5]), spec=spec, rng=random.Random(0))
    # 5 -> 2 -> 8, -7 -> -2 -> -8; 1.25 * 4 = 5 and -0.5 * 4 = -2 are already integers.
    assert q.dtype == np.int64 and q.tolist() == [8, -8, 5, -2]


def test_twos_complement_worked_by_hand() -> None:
    q = np.array([-1, 0, 1, -(2**31), 2**31 - 1], dtype=np.int64)
    r = to_ring(q, bits=32)
    assert r.dtype == np.uint32
    assert r.tolist() == [U32 - 1, 0, 1, 2**31, 2**31 - 1]
    assert from_ring(r).tolist() == q.tolist()
    wide = to_ring(np.array([-1, -(2**63)], dtype=np.int64), bits=64)
    assert wide.tolist() == [2**64 - 1, 2**63]
    assert from_ring(wide).tolist() == [-1, -(2**63)]
    with pytest.raises(TypeError):
        to_ring(np.array([1.0]), bits=32)


def test_a_negative_sum_decodes_across_the_wrap() -> None:
    # -3 + 1 = -2: in the ring (2^32 - 3) + 1 = 2^32 - 2, read back as -2, divided by 4.
    spec = QuantiseSpec(clip=1.0, scale=4.0, bits=32)
    total = ring_add(
        to_ring(np.array([-3], dtype=np.int64), bits=32),
        to_ring(np.array([1], dtype=np.int64), bits=32),
    )
    assert decode(total, spec=spec).tolist() == [-0.5]


def test_stochastic_rounding_is_unbiased() -> None:
    spec = QuantiseSpec(clip=1.0, scale=10.0, bits=32)
    draws = round_scaled(np.full(20_000, 0.12), spec=spec, rng=random.Random(3))
    # y = 1.2: 2 with probability 0.2, else 1. Standard error sqrt(0.16 / 20000) = 0.0028;
    # round-to-nearest would give exactly 1, 70 standard errors away.
    assert set(draws.tolist()) == {1, 2}
    assert abs(draws.mean() - 1.2) < 5 * 0.0029


def test_uniforms_lie_in_the_unit_interval_and_come_from_the_source() -> None:
    u = uniforms(1000, random.Random(5))
    assert u.min() >= 0.0 and u.max() < 1.0
    np.testing.assert_array_equal(u, uniforms(1000, random.Random(5)))
    assert not np.array_equal(u, uniforms(1000, random.Random(6)))


@pytest.mark.parametrize("bits", [32, 64])
def test_decoded_sum_is_within_the_bound_of_the_clipped_sum(bits: Bits) -> None:
    spec = QuantiseSpec(clip=1.5, scale=2.0**12, bits=bits)
    data = np.random.default_rng(2).normal(scale=1.0, size=(7, 50))
    rng = random.Random(9)
    total = np.zeros(50, dtype=np.uint32 if bits == 32 else np.uint64)
    for row in data:
        total = ring_add(total, encode(row, spec=spec, rng=rng))
    error = np.abs(decode(total, spec=spec) - np.clip(data, -1.5, 1.5).sum(axis=0))
    assert sum_error_bound(7, spec=spec) == 7 / 4096
    assert error.max() < sum_error_bound(7, spec=spec)
    assert error.max() > 0  # the rounding did happen: the bound is not vacuous here


def test_max_devices_worked_by_hand() -> None:
    spec = QuantiseSpec(clip=1.0, scale=2.0**10, bits=32)
    # One device sends at most 1024 units; (2^31 - 1) // 1024 = 2097151.
    assert max_devices(spec=spec) == 2_097_151
    # Headroom 2000: (2^31 - 1 - 2000) // 1024 = 2147481647 // 1024 = 2097150.
    assert max_devices(spec=spec, headroom=2000) == 2_097_150
    # clip * scale = 2.5: stochastic rounding can reach 3 units, so 3 is the per-device bound.
    odd = QuantiseSpec(clip=1.25, scale=2.0, bits=32)
    assert odd.unit_bound == 3
    assert max_devices(spec=odd) == (2**31 - 1) // 3
    assert round_scaled(np.full(200, 9.0), spec=odd, rng=random.Random(1)).max() == 3


def test_the_sum_wraps_one_device_past_max_devices() -> None:
    spec = QuantiseSpec(clip=1.0, scale=2.0**29, bits=32)
    n = max_devices(spec=spec)
    assert n == 3  # (2^31 - 1) // 2^29
    one = encode(np.array([1.0]), spec=spec, rng=random.Random(0))
    total = np.zeros(1, dtype=np.uint32)
    for _ in range(n):
        total = ring_add(total, one)
    assert decode(total, spec=spec).tolist() == [3.0]
    assert decode(ring_add(total, one), spec=spec).tolist() == [-4.0]  # 2^31 wraps


def test_bad_specs_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="clip"):
        QuantiseSpec(clip=0.0, scale=1.0)
    with pytest.raises(ValueError, match="scale"):
        QuantiseSpec(clip=1.0, scale=float("inf"))
    with pytest.raises(ValueError, match="no room"):
        QuantiseSpec(clip=1.0, scale=2.0**31, bits=32)
    with pytest.raises(ValueError, match="ring width"):
        QuantiseSpec(clip=1.0, scale=1.0, bits=16)  # type: ignore[arg-type]
    spec = QuantiseSpec(clip=1.0, scale=1.0, bits=32)
    with pytest.raises(ValueError, match="NaN"):
        encode(np.array([np.nan]), spec=spec)
    with pytest.raises(TypeError):
        decode(np.zeros(2, dtype=np.uint64), spec=spec)
    with pytest.raises(ValueError, match="negative"):
        max_devices(spec=spec, headroom=-1)
