"""A seeded corpus of random and mutated payloads for the protocol decoders.

Shared by the decoder fuzz test and by the coordinator test that publishes malformed
updates over a real broker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import msgpack

_ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    2**31,
    2**63 - 1,
    -(2**63),
    1.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x" * 300,
    "a/b",
    "+",
    "#",
    "\x00",
    b"",
    b"\x00" * 7,
    [],
    [1, 1],
    [-1],
    {},
    {"k": 1},
    {"dtype": "f4", "shape": [1], "data": b"\x00\x00\xc0\x7f"},
    {"dtype": "f4", "shape": [2**40], "data": b""},
    {"dtype": "f8", "shape": [1], "data": b"\x00" * 8},
    {"dtype": "f2", "shape": [-1], "data": b""},
    {"dtype": "f2", "shape": [1, 1, 1, 1, 1], "data": b"\x00\x00"},
]


def _mutate_structure(rng: random.Random, obj: Any) -> Any:
    """Replace, delete or add one entry somewhere inside a decoded message."""
    if isinstance(obj, dict) and obj:
        key = rng.choice(list(obj))
        roll = rng.random()
        if roll < 0.2:
            return {k: v for k, v in obj.items() if k != key}
        if roll < 0.3:
            return {**obj, rng.choice(["extra", "V", "", "dtype"]): rng.choice(_ODD_VALUES)}
        if roll < 0.6:
            return {**obj, key: rng.choice(_ODD_VALUES)}
        return {**obj, key: _mutate_structure(rng, obj[key])}
    if isinstance(obj, list) and obj:
        i = rng.randrange(len(obj))
        return [*obj[:i], rng.choice(_ODD_VALUES), *obj[i + 1 :]]
    return rng.choice(_ODD_VALUES)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    roll = rng.random()
    if roll < 0.4 and buf:
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif roll < 0.6:
        del buf[rng.randrange(len(buf) + 1) :]
    elif roll < 0.8:
        at = rng.randrange(len(buf) + 1)
        buf[at:at] = rng.randbytes(rng.randint(1, 16))
    elif buf:
        start = rng.randrange(len(buf))
        del buf[start : start + rng.randint(1, 32)]
    return bytes(buf)


def payloads(valid: list[bytes], *, count: int, seed: int) -> Iterator[bytes]:
    """``count`` payloads: random bytes, byte-level mutations and structural mutations of
    the ``valid`` payloads (about a third each)."""
    rng = random.Random(seed)
    decoded = [msgpack.unpackb(v, raw=False) for v in valid]
    for _ in range(count):
        kind = rng.random()
        if kind < 0.3:
            yield rng.randbytes(rng.randint(0, 300))
        elif kind < 0.65:
            yield _mutate_bytes(rng, rng.choice(valid))
        else:
            obj = _mutate_structure(rng, rng.choice(decoded))
            yield msgpack.packb(obj, use_bin_type=True)
