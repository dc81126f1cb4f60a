"""A bundle's public basis for closed-form fleets (closed_form/basis.py), made from images
the tool renders itself: the zoo's three source tasks (letters, shapes, font digits), so
no private row and no download enters it. ``edge-export basis BUNDLE`` writes it into the
bundle folder as ``basis.npy``; a fleet uses it when both its devices and its coordinator
name that file as ``closed_form.basis``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from closed_form.basis import BASIS_FILE, public_basis
from export import bundle as bundle_mod
from export import render
from export.runtime import BackboneRuntime, RuntimeSettings
from runtime.files import atomic_write

#: The rendered tasks and how many images of each: 9,000 rows for a covariance of the
#: zoo's 896 features (the probe behind closed_form/basis.py used these).
TASKS = ("letters", "shapes", "digits")
PER_TASK = 3000
#: Not the zoo's training seed (0): the basis sees images the backbones were not fit on.
SEED = 9876


def public_rows(bundle: bundle_mod.Bundle, *, per_task: int = PER_TASK, seed: int = SEED,
                progress: Any = None) -> np.ndarray:  # fmt: skip
    """(len(TASKS) * per_task, D) features of rendered images through ``bundle``."""
    if per_task < 1:
        raise ValueError(f"per_task must be positive, got {per_task}")
    runtime = BackboneRuntime(bundle, settings=RuntimeSettings())
    parts = []
    for i, task in enumerate(TASKS):
        images, _, _ = render.render_task(task, per_task, seed=seed + i)
        parts.append(runtime.extract(images.astype(np.float32), progress=progress))
    return np.concatenate(parts).astype(np.float64)


def write_basis(path: Path, *, per_task: int = PER_TASK, seed: int = SEED,
                progress: Any = None) -> Path:  # fmt: skip
    """Make the public basis of the bundle at ``path`` and store it there; its file."""
    bundle = bundle_mod.load(path)
    if len(TASKS) * per_task <= bundle.feature_dim:
        # Fewer rows than features leave directions the rows never reach; whitened, those
        # would be the longest columns and swamp every projected row.
        raise ValueError(
            f"{len(TASKS)} x {per_task} rendered images cannot whiten {bundle.feature_dim} "
            f"features: --per-task must be above {bundle.feature_dim // len(TASKS)}"
        )
    basis = public_basis(public_rows(bundle, per_task=per_task, seed=seed, progress=progress))
    buffer = io.BytesIO()
    np.save(buffer, basis, allow_pickle=False)
    out = Path(path) / BASIS_FILE
    atomic_write(out, buffer.getvalue())
    return out
