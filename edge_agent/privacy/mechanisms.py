"""What leaves the device: prototypes and counts, released by a mechanism from a registry.

- ``none``: the exact local prototypes (FedPCL Eq. 5) of the classes present.
- ``paper``: FedPCL A.2.4 as its released code applies it: ``C' = (1 - p) * C + e`` with
  ``e`` per coordinate from N(0, s^2) or Laplace(0, s). No formal guarantee.
- ``dp``: a Gaussian mechanism on the per-class sums of ``z`` (each ``|z| = 1``, so the L2
  sensitivity of a sum under adding or removing one example is 1) and on the per-class
  counts (sensitivity 1); every class is sent, present or not, so the set of classes
  reveals nothing; prototype = noisy sum / max(1, noisy count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Release:
    classes: np.ndarray  # (k,) class indices sent
    prototypes: np.ndarray  # (k, d)
    counts: np.ndarray  # (k,) non-negative integers


@dataclass(frozen=True, kw_only=True)
class MechanismParams:
    paper_noise: str = "gaussian"  # or "laplace"
    paper_scale: float = 0.05
    paper_p: float = 0.1
    sum_sigma: float = 1.0  # dp: noise multiplier of the sums
    count_sigma: float = 1.0  # dp: noise multiplier of the counts


Mechanism = Callable[[np.ndarray, np.ndarray, int, MechanismParams, np.random.Generator], Release]


def _sums(z: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    sums = np.zeros((num_classes, z.shape[1]), np.float64)
    np.add.at(sums, labels, z.astype(np.float64))
    return sums, np.bincount(labels, minlength=num_classes).astype(np.float64)


def release_none(z: np.ndarray, labels: np.ndarray, num_classes: int,
                 params: MechanismParams, rng: np.random.Generator) -> Release:  # fmt: skip
    sums, counts = _sums(z, labels, num_classes)
    held = np.flatnonzero(counts > 0)
    protos = sums[held] / counts[held, None]
    return Release(held, protos.astype(np.float32), counts[held].astype(np.int64))


def release_paper(z: np.ndarray, labels: np.ndarray, num_classes: int,
                  params: MechanismParams, rng: np.random.Generator) -> Release:  # fmt: skip
    exact = release_none(z, labels, num_classes, params, rng)
    shape = exact.prototypes.shape
    if params.paper_noise == "gaussian":
        noise = rng.normal(0.0, params.paper_scale, size=shape)
    elif params.paper_noise == "laplace":
        noise = rng.laplace(0.0, params.paper_scale, size=shape)
    else:
        raise ValueError(f"paper noise must be gaussian or laplace, got {params.paper_noise!r}")
    noisy = (1 - params.paper_p) * exact.prototypes + noise
    return Release(exact.classes, noisy.astype(np.float32), exact.counts)


def release_dp(z: np.ndarray, labels: np.ndarray, num_classes: int,
               params: MechanismParams, rng: np.random.Generator) -> Release:  # fmt: skip
    norms = np.linalg.norm(z, axis=1)
    if len(z) and not np.allclose(norms, 1.0, atol=1e-3):
        raise ValueError("dp release needs unit-norm embeddings (sensitivity 1)")
    sums, counts = _sums(z, labels, num_classes)
    noisy_sums = sums + rng.normal(0.0, params.sum_sigma, size=sums.shape)
    noisy_counts = counts + rng.normal(0.0, params.count_sigma, size=counts.shape)
    protos = noisy_sums / np.maximum(1.0, noisy_counts)[:, None]
    # Post-processing: counts travel as non-negative integers.
    sent_counts = np.maximum(0, np.rint(noisy_counts)).astype(np.int64)
    return Release(np.arange(num_classes), protos.astype(np.float32), sent_counts)


MECHANISMS: dict[str, Mechanism] = {
    "none": release_none,
    "paper": release_paper,
    "dp": release_dp,
}
