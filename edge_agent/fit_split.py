"""A device's own data split in two: the part its candidate models fit and the part that
chooses between them (neither leaves the device). Used by a dp-features device's anchored
learner (``edge_agent/anchored.py``) and a closed-form device's choice of head
(``edge_agent/closed_form.py``); free of torch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FitSplit:
    """Indices of the samples the probes train on and of those that score them."""

    fit: np.ndarray
    val: np.ndarray

    @classmethod
    def stratified(cls, labels: np.ndarray, *, share: float, seed: int) -> FitSplit:
        """About ``share`` of every class with at least two samples goes to validation
        (at least one, never all); a class with one sample stays in the fit split."""
        rng = np.random.default_rng(seed)
        val: list[np.ndarray] = []
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            if len(idx) >= 2:
                val.append(idx[: min(len(idx) - 1, max(1, round(share * len(idx))))])
        held = np.sort(np.concatenate(val)) if val else np.zeros(0, np.int64)
        return cls(np.setdiff1d(np.arange(len(labels)), held), held)
