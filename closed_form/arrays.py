"""The array plumbing every part of the closed form shares: read-only float64 copies checked
for shape and finiteness, checked feature rows and labels, the projection onto positive
semi-definite matrices, and a solve that says which system was singular."""

from __future__ import annotations

import math
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

F64: TypeAlias = npt.NDArray[np.float64]
I64: TypeAlias = npt.NDArray[np.int64]
Bools: TypeAlias = npt.NDArray[np.bool_]


def frozen(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a.setflags(write=False)
    return a


def float_array(name: str, value: object, shape: tuple[int, ...]) -> F64:
    """A read-only float64 copy of ``value`` of exactly ``shape``, every entry finite."""
    try:
        arr = np.array(value, dtype=np.float64, copy=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not a numeric array: {exc}") from exc
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} has non-finite entries")
    return frozen(arr)


def checked_labels(labels: npt.ArrayLike, rows: int, num_classes: int) -> I64:
    lab = np.asarray(labels)
    if lab.shape != (rows,):
        raise ValueError(f"labels have shape {lab.shape}, expected ({rows},) to match the rows")
    if rows and not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {lab.dtype}")
    lab = lab.astype(np.int64)
    if rows and (lab.min() < 0 or lab.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got {lab.min()}..{lab.max()}")
    return lab


def checked_rows(x: npt.ArrayLike, name: str = "x") -> F64:
    rows = np.asarray(x, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array of feature rows, got shape {rows.shape}")
    if not np.isfinite(rows).all():
        raise ValueError(f"{name} has non-finite entries")
    return rows


def psd(m: F64, *, floor: float = 0.0) -> F64:
    """``m`` symmetrised, its eigenvalues below ``floor`` (default 0: the negative ones)
    raised to it; as it is (symmetrised) when ``floor`` is 0 and a Cholesky factorisation
    shows it positive definite already, the cheap common case."""
    if not (math.isfinite(floor) and floor >= 0):
        raise ValueError(f"floor must be a non-negative finite number, got {floor!r}")
    sym = (m + m.T) / 2.0
    if floor == 0.0:
        try:
            np.linalg.cholesky(sym)
            return sym
        except np.linalg.LinAlgError:
            pass
    values, vectors = np.linalg.eigh(sym)
    out = (vectors * np.maximum(values, floor)) @ vectors.T
    return (out + out.T) / 2.0


#: How many of its noise's standard deviations a direction's summed scatter must clear to
#: be told apart from that noise (:func:`noise_floor`).
FLOOR_SDS = 3.0


def noise_floor(noise_std: float) -> float:
    """The eigenvalue below which a summed matrix (a Gram or a scatter) carrying
    independent noise of standard deviation ``noise_std`` on each entry of its upper
    triangle tells a direction nothing apart from that noise: :data:`FLOOR_SDS` standard
    deviations of ``v^T E v`` for a unit ``v``, at most ``sqrt(2) noise_std`` (the
    diagonal's draws once, each off-diagonal one twice), so ``3 sqrt(2) noise_std``. 0
    without noise. On digits-5 through the zoo it is within a point of the best of floors
    from 2 to 12 standard deviations at k 64 to 512, 100 and 1,000 devices and epsilons 1
    to 1000, where a floor scaled with the noise's spectral norm (``2 sqrt(k)`` of them)
    cost up to 2 points at k 512."""
    if not (math.isfinite(noise_std) and noise_std >= 0):
        raise ValueError(f"noise_std must be a non-negative finite number, got {noise_std!r}")
    return FLOOR_SDS * math.sqrt(2.0) * noise_std


def solve(a: F64, b: F64, what: str) -> F64:
    try:
        out = np.asarray(np.linalg.solve(a, b), dtype=np.float64)
    except np.linalg.LinAlgError as exc:
        raise ValueError(f"{what} is singular: {exc}") from exc
    return out
