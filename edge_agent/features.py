"""The on-disk feature cache: backbones run once per sample, ever.

Features ``r_x`` (N, K*d_e) of a data set are stored as a memory-mapped ``.npy`` keyed by
the bundle id and a fingerprint of the data, so a second epoch, a second round or a
restart reads them back instead of running the backbones. Entries of other bundles are
dropped when a new bundle is used (features of different backbones never mix).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from protocol.files import fsync_dir

Extractor = Callable[[np.ndarray], np.ndarray]


def fingerprint(images: np.ndarray, labels: np.ndarray | None = None) -> str:
    """sha256 over the shape, dtype and bytes of the images (and labels)."""
    digest = hashlib.sha256()
    digest.update(json.dumps([list(images.shape), str(images.dtype)]).encode())
    flat = np.ascontiguousarray(images).reshape(-1).view(np.uint8)
    step = 1 << 24
    for start in range(0, flat.size, step):
        digest.update(flat[start : start + step].tobytes())
    if labels is not None:
        digest.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    return digest.hexdigest()


class FeatureCache:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, bundle_id: str, data_fingerprint: str) -> Path:
        return self.root / f"{bundle_id[:16]}-{data_fingerprint[:24]}.npy"

    def entries(self) -> list[dict[str, Any]]:
        out = []
        for npy in sorted(self.root.glob("*.npy")):
            arr = np.load(npy, mmap_mode="r")
            bundle, _, data = npy.stem.partition("-")
            out.append({"file": npy.name, "bundle": bundle, "data": data, "shape": list(arr.shape)})
        return out

    def prune(self, *, keep_bundle: str) -> list[str]:
        """Delete the entries of every other bundle; returns the removed file names."""
        removed = []
        for npy in self.root.glob("*.npy"):
            if not npy.name.startswith(keep_bundle[:16] + "-"):
                npy.unlink()
                removed.append(npy.name)
        return removed

    def features(
        self,
        bundle_id: str,
        images: np.ndarray,
        extract: Extractor,
        *,
        dim: int,
        labels: np.ndarray | None = None,
        batch: int = 256,
        progress: Any = None,
    ) -> np.ndarray:
        """The cached features of ``images``, computing (in batches, straight to disk) only
        on a miss. The result is a read-only memory map."""
        target = self.path(bundle_id, fingerprint(images, labels))
        if target.exists():
            cached = np.load(target, mmap_mode="r")
            if cached.shape == (len(images), dim):
                return cached
            target.unlink()  # a stale or foreign file under our name: recompute
        self.prune(keep_bundle=bundle_id)
        tmp = target.with_name(target.name + ".partial")
        try:
            out = np.lib.format.open_memmap(
                tmp, mode="w+", dtype=np.float32, shape=(len(images), dim)
            )
            for start in range(0, len(images), batch):
                chunk = extract(images[start : start + batch])
                out[start : start + len(chunk)] = chunk
                if progress is not None:
                    progress.update(len(chunk))
            out.flush()
            del out
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        tmp.replace(target)  # atomic: a crash leaves either no entry or a complete one
        fsync_dir(self.root)
        return np.load(target, mmap_mode="r")
