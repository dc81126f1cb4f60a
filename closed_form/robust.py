"""One device's weight in the fleet's sum, bounded: per class, a device counts at most a
multiple of the class's lower median count among the devices holding it, its sums and
second moment scaled to match (the coordinator keeps every client's statistics, so it
can bound each before summing; coordinator/rounds/statistics.py).

A capped device's statistics stay the statistics of some data: the class means and the
within-class spread are its own, only their weight shrinks. Its second moment splits into
the within-class scatter ``W = G - sum_c s_c s_c^T / n_c`` and the class-mean part; the
class-mean part of class c is scaled by that class's factor ``w_c``, ``W`` by the
device's overall factor ``sum_c w_c n_c / N``."""

from __future__ import annotations

import numpy as np

from closed_form.arrays import F64
from closed_form.statistics import Statistics


def count_caps(counts: F64, multiple: float) -> F64:
    """(C,) the most one device may count per class: ``multiple`` times the class's lower
    median count over the devices (rows of ``counts``, (D, C)) holding it (count >= 1);
    ``inf`` where none does. The lower median is a count some device has."""
    n = np.asarray(counts, dtype=np.float64)
    if n.ndim != 2:
        raise ValueError(f"counts must be (devices, classes), got shape {n.shape}")
    if not multiple >= 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    caps = np.full(n.shape[1], np.inf)
    for c in range(n.shape[1]):
        held = np.sort(n[n[:, c] >= 1.0, c])
        if held.size:
            caps[c] = multiple * held[(held.size - 1) // 2]
    return caps


def capped(part: Statistics, caps: F64) -> Statistics:
    """``part`` (one device's) with each class's count at most ``caps`` (module text);
    ``part`` itself when no class is above its cap."""
    n = part.counts
    over = n > caps
    if not over.any():
        return part
    w = np.where(over, caps / np.where(over, n, 1.0), 1.0)  # (C,) in (0, 1]
    gram = None
    if part.gram is not None:
        held = n > 0
        # s_c s_c^T / n_c per held class, weighted by w_c or by 1.
        means = part.sums[held] / n[held][:, None]
        between = part.sums[held].T @ means
        between_w = (w[held][:, None] * part.sums[held]).T @ means
        overall = float(
            (w * np.maximum(n, 0.0)).sum() / max(float(np.maximum(n, 0.0).sum()), 1e-300)
        )
        gram = overall * (part.gram - between) + between_w
        gram = (gram + gram.T) / 2.0  # exactly symmetric, as Statistics requires
    scatter = None if part.scatter is None else part.scatter * w[:, None, None]
    return Statistics(counts=n * w, sums=part.sums * w[:, None], gram=gram,
                      holders=part.holders, scatter=scatter, devices=part.devices)  # fmt: skip
