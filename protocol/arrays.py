"""Arrays on the wire: ``{"dtype": "f2"|"f4"|"f8", "shape": [...], "data": <raw LE bytes>}``.

Raw little-endian bytes keep a 10 x 256 float16 prototype set at 5 KiB and make encoding a
memory copy instead of a per-float loop. ``f8`` carries what must add up exactly over a
fleet: the class statistics of the closed-form methods (protocol/methods.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ArrayError
from protocol.limits import MAX_ARRAY_NDIM

WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    "f2": np.dtype("<f2"),
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
}
_NAMES = {np.dtype(np.float16): "f2", np.dtype(np.float32): "f4", np.dtype(np.float64): "f8"}
_BY_SIZE = {2: "f2", 4: "f4", 8: "f8"}

FloatArray = NDArray[np.floating[Any]]


def check_array(value: object, *, field: str, ndim: int | None = None) -> FloatArray:
    """Validate an in-memory array and return a read-only little-endian copy if needed."""
    if not isinstance(value, np.ndarray):
        raise ArrayError(f"expected a numpy array, got {type(value).__name__}", field=field)
    name = _NAMES.get(value.dtype.newbyteorder("=")) if value.dtype.kind == "f" else None
    if name is None:
        raise ArrayError(
            f"dtype must be float16, float32 or float64, got {value.dtype}", field=field
        )
    if value.ndim > MAX_ARRAY_NDIM or (ndim is not None and value.ndim != ndim):
        want = ndim if ndim is not None else f"at most {MAX_ARRAY_NDIM}"
        raise ArrayError(f"expected {want} dimensions, got shape {value.shape}", field=field)
    if not np.isfinite(value).all():
        raise ArrayError("contains NaN or Inf", field=field)
    wire = WIRE_DTYPES[name]
    if value.flags.writeable or value.dtype != wire or not value.flags.c_contiguous:
        value = np.ascontiguousarray(value, dtype=wire).copy()
        value.setflags(write=False)
    return value


def encode_array(value: FloatArray) -> dict[str, Any]:
    # check_array guarantees a C-contiguous little-endian f2/f4 array, so the buffer
    # itself is the wire form and no copy is needed.
    return {
        "dtype": _BY_SIZE[value.itemsize],
        "shape": list(value.shape),
        "data": value.data,
    }


def decode_array(obj: object, *, field: str, ndim: int | None = None) -> FloatArray:
    """Decode the wire form of an array; the result is read-only and validated."""
    if not isinstance(obj, dict):
        raise ArrayError("expected an array map", field=field)
    if set(obj) != {"dtype", "shape", "data"}:
        raise ArrayError(
            f"array map must have exactly dtype, shape, data; got {sorted(map(str, obj))}",
            field=field,
        )
    dtype = WIRE_DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise ArrayError(f"unsupported dtype {obj['dtype']!r}", field=field)
    shape = obj["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_ARRAY_NDIM
        or not all(type(n) is int and n >= 0 for n in shape)
    ):
        raise ArrayError(f"bad shape {shape!r}", field=field)
    if ndim is not None and len(shape) != ndim:
        raise ArrayError(f"expected {ndim} dimensions, got shape {shape}", field=field)
    data = obj["data"]
    if not isinstance(data, bytes):
        raise ArrayError("data must be a byte string", field=field)
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise ArrayError(
            f"shape {shape} with dtype {obj['dtype']} needs {expected} bytes, got {len(data)}",
            field=field,
        )
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    if not np.isfinite(array).all():
        raise ArrayError("contains NaN or Inf", field=field)
    return array
