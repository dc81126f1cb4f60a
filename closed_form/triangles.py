"""The released form of a Gram matrix: its upper triangle, diagonal included, in
``np.triu_indices`` order, and the lengths such a triangle can have."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from closed_form.arrays import F64


def triangle_size(k: int) -> int:
    """Entries of the upper triangle (with diagonal) of a ``k x k`` matrix: ``k(k+1)/2``."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
        raise ValueError(f"dimension must be a non-negative integer, got {k!r}")
    return int(k) * (int(k) + 1) // 2


def dim_of_triangle(n: int) -> int:
    """The ``k`` with ``triangle_size(k) == n``; ValueError when ``n`` is not triangular."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"triangle length must be a non-negative integer, got {n!r}")
    k = (math.isqrt(8 * int(n) + 1) - 1) // 2
    if triangle_size(k) != n:
        raise ValueError(f"{n} is not a triangular number k(k+1)/2, so not an upper triangle")
    return k


def upper_triangle(g: npt.ArrayLike) -> F64:
    """The upper triangle of a square matrix, diagonal included, in ``np.triu_indices`` order.

    This is the released form of a Gram matrix: the lower half repeats it, and sending it
    would both double the bytes and (under noise) break the symmetry.
    """
    m = np.asarray(g, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"upper_triangle needs a square matrix, got shape {m.shape}")
    return m[np.triu_indices(m.shape[0])]


def from_upper_triangle(v: npt.ArrayLike) -> F64:
    """The symmetric matrix whose upper triangle (``np.triu_indices`` order) is ``v``."""
    flat = np.asarray(v, dtype=np.float64)
    if flat.ndim != 1:
        raise ValueError(f"from_upper_triangle needs a flat vector, got shape {flat.shape}")
    k = dim_of_triangle(flat.shape[0])
    rows, cols = np.triu_indices(k)
    out = np.zeros((k, k), dtype=np.float64)
    out[rows, cols] = flat
    out[cols, rows] = flat
    return out
