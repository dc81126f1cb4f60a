"""The workload both halves of the side-by-side benchmark run: FedAvg of ProtoFleet's head
over one fleet of clients, on synthetic cached features, so neither half needs a backbone.

One (U, D) feature matrix holds every sample of the fleet; a client owns the rows its
``train_index`` names, and ``test_rows`` name a held-out test set that no client trains
on, which every engine's global model is scored on (bench/peer_accuracy.py). Features are class means plus a per-client shift plus noise: a
feature-shift fleet in miniature, learnable by a linear head yet not identical per client.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Workload:
    features: np.ndarray  # (U, D) float32, every client's samples
    train_index: tuple[np.ndarray, ...]  # per client (n_k,) int64 rows of ``features``
    train_labels: tuple[np.ndarray, ...]  # per client (n_k,) int64 in [0, num_classes)
    num_classes: int
    epochs: int
    batch_size: int
    seed: int
    test_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (T,) rows
    test_labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (T,)

    def __post_init__(self) -> None:
        if self.features.ndim != 2 or self.features.dtype != np.float32:
            raise ValueError(
                f"features must be a (U, D) float32 matrix, got {self.features.dtype} "
                f"{self.features.shape}"
            )
        if len(self.train_index) != len(self.train_labels) or not self.train_index:
            raise ValueError("need one train_index and one train_labels per client, >= 1 client")
        rows = len(self.features)
        for k, (index, labels) in enumerate(zip(self.train_index, self.train_labels, strict=True)):
            if index.shape != labels.shape or index.ndim != 1:
                raise ValueError(f"client {k}: train_index and train_labels differ in shape")
            if index.size and (index.min() < 0 or index.max() >= rows):
                raise ValueError(f"client {k}: train_index outside the {rows} feature rows")
            if labels.size and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise ValueError(f"client {k}: a label outside [0, {self.num_classes})")
        if self.test_rows.shape != self.test_labels.shape or self.test_rows.ndim != 1:
            raise ValueError("test_rows and test_labels differ in shape")
        if self.test_rows.size and (self.test_rows.min() < 0 or self.test_rows.max() >= rows):
            raise ValueError(f"test_rows outside the {rows} feature rows")
        if self.test_labels.size and (
            self.test_labels.min() < 0 or self.test_labels.max() >= self.num_classes
        ):
            raise ValueError(f"a test label outside [0, {self.num_classes})")
        if self.epochs < 1 or self.batch_size < 2:
            raise ValueError("epochs must be >= 1 and batch_size >= 2")

    @property
    def clients(self) -> int:
        return len(self.train_index)

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    def flat(self) -> dict[str, np.ndarray]:
        """The workload as four arrays: ``features``; every client's rows and labels one
        after another (``index``, ``labels``), client k's at ``offsets[k]:offsets[k+1]``."""
        lengths = [len(i) for i in self.train_index]
        return {
            "features": self.features,
            "index": np.concatenate(self.train_index).astype(np.int64),
            "labels": np.concatenate(self.train_labels).astype(np.int64),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        }

    def client_data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """(n_k, D) features and (n_k,) labels of one client."""
        return self.features[self.train_index[client]], self.train_labels[client]


def make_workload(
    *,
    clients: int,
    per_client: int,
    dim: int,
    classes: int,
    seed: int,
    epochs: int = 1,
    batch_size: int = 32,
    shift: float = 0.5,
    noise: float = 1.0,
) -> Workload:
    """A seeded synthetic fleet: ``clients`` x ``per_client`` samples of dimension ``dim``.

    A sample of class c on client k is ``mean_c + shift_k + noise``: the class means are
    unit-variance Gaussians (well apart in ``dim`` dimensions, so a linear head learns
    them), each client's shift is a Gaussian of scale ``shift``. A client's rows are
    scattered over the matrix (a seeded permutation), so an engine that assumed
    contiguous blocks would be caught out.
    """
    if clients < 1 or per_client < 1 or dim < 1 or classes < 2:
        raise ValueError("need clients, per_client, dim >= 1 and classes >= 2")
    rng = np.random.default_rng(seed)
    f32 = np.float32
    means = rng.standard_normal((classes, dim), dtype=f32)  # (C, D)
    shifts = f32(shift) * rng.standard_normal((clients, dim), dtype=f32)  # (K, D)
    labels = rng.integers(0, classes, size=(clients, per_client))  # (K, n)
    rows = rng.permutation(clients * per_client).reshape(clients, per_client)  # (K, n)
    samples = rng.standard_normal((clients, per_client, dim), dtype=f32)  # (K, n, D)
    samples *= f32(noise)
    samples += means[labels] + shifts[:, None, :]
    features = np.empty((clients * per_client, dim), dtype=f32)
    features[rows.reshape(-1)] = samples.reshape(-1, dim)
    return Workload(
        features=features,
        train_index=tuple(r.astype(np.int64) for r in rows),
        train_labels=tuple(y.astype(np.int64) for y in labels),
        num_classes=classes,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
    )


def save_workload(workload: Workload, path: Path) -> None:
    """``workload`` in one .npz file (the halves of the benchmark each load it in a
    process of their own)."""
    scalars = [workload.num_classes, workload.epochs, workload.batch_size, workload.seed]
    # Any: numpy's stub would take a ** mapping of arrays for its own keyword flags.
    arrays: dict[str, Any] = workload.flat() | {
        "scalars": np.array(scalars, np.int64),
        "test_rows": workload.test_rows,
        "test_labels": workload.test_labels,
    }
    np.savez(path, **arrays)


def load_workload(path: Path) -> Workload:
    """The workload :func:`save_workload` wrote."""
    with np.load(path) as saved:
        offsets = saved["offsets"]
        index, labels = saved["index"], saved["labels"]
        num_classes, epochs, batch_size, seed = (int(v) for v in saved["scalars"])
        parts = list(itertools.pairwise(offsets.tolist()))
        return Workload(
            features=saved["features"],
            train_index=tuple(index[a:b] for a, b in parts),
            train_labels=tuple(labels[a:b] for a, b in parts),
            num_classes=num_classes,
            epochs=epochs,
            batch_size=batch_size,
            seed=seed,
            test_rows=saved["test_rows"],
            test_labels=saved["test_labels"],
        )
