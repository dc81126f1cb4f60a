"""Class statistics as one map of raw arrays: the project's one encoding of summed
statistics wherever they leave memory inside the coordinator: a worker's part on the
tier's wire (coordinator/tier/partial_fields.py), the owner's total on disk
(coordinator/tier/owner_statistics.py) and a secure fleet's running sum in the meta table
(coordinator/rounds/secure.py). The map's values are bytes and integers, ready for msgpack.

- ``counts`` (C,), ``sums`` (C, k) row-major: little-endian float64;
- ``gram``: the second moment's upper triangle, row by row (closed_form/triangles.py),
  little-endian float64, or None (FedCOF);
- ``scatter`` (C, k, k): little-endian float64, or None (LDA, ridge);
- ``holders`` (C,): little-endian int64;
- ``devices``: an integer.

A device's own release is the protocol's (docs/protocol.md), and the secure sum adds a
flat vector of the same arrays (secagg/fleet.py::flatten); neither is a stored sum.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from closed_form.statistics import Statistics
from closed_form.triangles import from_upper_triangle, upper_triangle

KEYS = frozenset({"counts", "sums", "gram", "scatter", "holders", "devices"})

#: A sum over at most this many devices (float64 integers are exact below 2**53).
MAX_DEVICES = 2**53


def statistics_fields(stats: Statistics) -> dict[str, Any]:
    """``stats`` as the map of the module text."""
    return {
        "counts": _f8(stats.counts),
        "sums": _f8(stats.sums),
        "gram": None if stats.gram is None else _f8(upper_triangle(stats.gram)),
        "scatter": None if stats.scatter is None else _f8(stats.scatter),
        "holders": np.ascontiguousarray(stats.holders, "<i8").tobytes(),
        "devices": stats.devices,
    }


def statistics_from(obj: object, *, num_classes: int, dim: int) -> Statistics:
    """The statistics of :func:`statistics_fields` for ``num_classes`` x ``dim``, checked:
    every key and length, exactly one of a second moment and a scatter, finite values,
    holders within the devices. Any problem is a ``ValueError`` naming it."""
    if not isinstance(obj, dict) or set(obj) != KEYS:
        raise ValueError(f"statistics must be a map of {sorted(KEYS)}")
    c, d = num_classes, dim
    if (obj["gram"] is None) == (obj["scatter"] is None):
        raise ValueError("statistics carry a second moment or a scatter, not both or neither")
    devices = obj["devices"]
    if type(devices) is not int or not 0 <= devices <= MAX_DEVICES:
        raise ValueError(f"devices must be an integer in 0..{MAX_DEVICES}")
    gram = None if obj["gram"] is None else _array(obj, "gram", "<f8", (d * (d + 1) // 2,))
    return Statistics(
        counts=_array(obj, "counts", "<f8", (c,)),
        sums=_array(obj, "sums", "<f8", (c, d)),
        gram=None if gram is None else from_upper_triangle(gram),
        scatter=None if obj["scatter"] is None else _array(obj, "scatter", "<f8", (c, d, d)),
        holders=_array(obj, "holders", "<i8", (c,)),
        devices=devices,
    )


def _f8(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, "<f8").tobytes()


def _array(obj: dict[str, Any], key: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    data = obj[key]
    size = int(np.prod(shape)) * 8
    if not isinstance(data, bytes) or len(data) != size:
        raise ValueError(f"{key} must be {size} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype[1:])
