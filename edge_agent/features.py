"""The on-disk feature cache: backbones run once per sample, ever.

Features ``r_x`` (N, K*d_e) of a data set are stored as an ``.npy`` (memory-mapped when
large) keyed by the bundle id and a fingerprint of the data, so a second epoch, a second
round or a restart reads them back instead of running the backbones. Beside each entry a ``.keys``
file holds one digest per sample: when a device's data set changes (new images collected,
some deleted, a label fixed), a private cache copies the rows of the samples it has seen
and runs the backbones on the new ones only, then drops the superseded entry. Entries of
other bundles are dropped when a new bundle is used (features of different backbones
never mix).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.files import fsync_dir

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from edge_agent.data import LocalData
    from export.runtime import BackboneRuntime

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


KEY_BYTES = 16


def row_keys(images: np.ndarray) -> np.ndarray:
    """(N, 16) uint8: a digest of each sample's bytes, shape and dtype; the name under which
    its features are found again when the data set around it changes."""
    head = json.dumps([list(images.shape[1:]), str(images.dtype)]).encode()
    keys = np.empty((len(images), KEY_BYTES), dtype=np.uint8)
    for i, row in enumerate(images):
        digest = hashlib.blake2b(head, digest_size=KEY_BYTES)
        digest.update(np.ascontiguousarray(row).tobytes())
        keys[i] = np.frombuffer(digest.digest(), dtype=np.uint8)
    return keys


class FeatureCache:
    """``shared``: other agents use ``root`` too (the agents of a simulated fleet). A
    shared cache neither borrows rows from nor removes the entries of data sets other than
    the one asked for; a private one (the default, ``<state_dir>/cache``) does both."""

    def __init__(self, root: Path, *, shared: bool = False) -> None:
        self.root = root
        self.shared = shared
        self.served: set[str] = set()  # entry names handed out by this object
        # The folder is made by the first write: reading (`edge-agent status`) creates nothing.

    def path(self, bundle_id: str, data_fingerprint: str) -> Path:
        return self.root / f"{bundle_id[:16]}-{data_fingerprint[:24]}.npy"

    def entries(self) -> list[dict[str, Any]]:
        out = []
        for npy in sorted(self.root.glob("*.npy")):
            arr = _load(npy)
            bundle, _, data = npy.stem.partition("-")
            shape = None if arr is None else list(arr.shape)  # None: damaged, to be recomputed
            out.append({"file": npy.name, "bundle": bundle, "data": data, "shape": shape})
        return out

    def prune(self, *, keep_bundle: str) -> list[str]:
        """Delete the entries of every other bundle; returns the removed file names."""
        removed = []
        for npy in self.root.glob("*.npy"):
            if not npy.name.startswith(keep_bundle[:16] + "-"):
                _remove_entry(npy)
                removed.append(npy.name)
        return removed

    def drop_unserved(self) -> list[str]:
        """Delete the entries this object did not serve (data sets that have changed since
        they were cached), key files without an entry and writes a crash cut short; returns
        the removed entries' names. Only for a private cache, once every data set of its
        agent has been served."""
        if self.shared:
            raise RuntimeError("a shared feature cache is not pruned by one of its users")
        removed = []
        for npy in self.root.glob("*.npy"):
            if npy.name not in self.served:
                _remove_entry(npy)
                removed.append(npy.name)
        for stray in [*self.root.glob("*.partial"), *self.root.glob("*.keys")]:
            if stray.suffix == ".partial" or not stray.with_suffix(".npy").exists():
                stray.unlink(missing_ok=True)
        return removed

    def _donors(
        self, bundle_id: str, dim: int, keys: np.ndarray
    ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """Which samples (by row) earlier entries of this bundle already hold: a mask over
        the rows of ``keys`` and, per entry, (its features, rows here, rows there)."""
        have = np.zeros(len(keys), dtype=bool)
        if not len(keys):
            return have, []
        wanted = {key.tobytes(): i for i, key in enumerate(keys)}
        found = []
        for npy in sorted(self.root.glob(f"{bundle_id[:16]}-*.npy")):
            key_file = npy.with_suffix(".keys")
            if not key_file.exists():
                continue
            old_keys, old = _load(key_file, mmap=False), _load(npy)
            if old_keys is None or old is None:
                continue  # unreadable: that entry simply cannot lend its rows
            if old.shape[1:] != (dim,) or old_keys.shape != (len(old), KEY_BYTES):
                continue
            here, there = [], []
            for j, key in enumerate(old_keys):
                i = wanted.get(key.tobytes())
                if i is not None and not have[i]:
                    have[i] = True
                    here.append(i)
                    there.append(j)
            if here:
                found.append((old, np.asarray(here), np.asarray(there)))
        return have, found

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
        what no entry holds. The result is read-only (a memory map when large)."""
        target = self.path(bundle_id, fingerprint(images, labels))
        if target.exists():
            cached = _load(target)
            if cached is not None and cached.shape == (len(images), dim):
                self.served.add(target.name)
                return cached
            _remove_entry(target)  # damaged, stale or foreign file under our name: recompute
        self.prune(keep_bundle=bundle_id)
        # A shared cache's entries are never borrowed from: no keys to compute or keep.
        keys = None if self.shared else row_keys(images)
        have, donors = (
            (np.zeros(len(images), dtype=bool), [])
            if keys is None
            else self._donors(bundle_id, dim, keys)
        )
        tmp = target.with_name(target.name + ".partial")
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            out = np.lib.format.open_memmap(
                tmp, mode="w+", dtype=np.float32, shape=(len(images), dim)
            )
            for old, here, there in donors:
                out[here] = old[there]
            todo = np.flatnonzero(~have)
            for start in range(0, len(todo), batch):
                rows = todo[start : start + batch]
                # Contiguous rows (the usual case: nothing cached) as a view, not a copy.
                whole = rows[-1] - rows[0] == len(rows) - 1
                chunk = extract(images[rows[0] : rows[-1] + 1] if whole else images[rows])
                out[rows] = chunk
                if progress is not None:
                    progress.update(len(chunk))
            out.flush()
            del out
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        # The keys go first: an entry without keys only loses the ability to lend rows.
        if keys is not None:
            _write_keys(target.with_suffix(".keys"), keys)
        tmp.replace(target)  # atomic: a crash leaves either no entry or a complete one
        fsync_dir(self.root)
        self.served.add(target.name)
        loaded = _load(target)
        if loaded is None:
            raise OSError(f"feature cache entry {target} cannot be read back")
        return loaded


class LoggedProgress:
    """Progress of a long backbone pass as log lines (a service has no terminal): one line
    every ``every_s`` seconds, so a first start on a large data set does not look hung."""

    def __init__(self, log: Any, *, what: str, total: int, every_s: float = 30.0) -> None:
        self.log, self.what, self.total, self.every_s = log, what, total, every_s
        self.done = 0
        self.start = self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            self.log.info(
                "%s: backbones ran on %d of %d samples (%.0f/s)",
                self.what,
                self.done,
                self.total,
                rate,
            )


#: Entries smaller than this are read into memory, not mapped. A map holds a file
#: descriptor for as long as the array lives (CPython's mmap keeps a duplicate), and a small
#: entry saves no memory by being mapped: a fleet worker hosting 250 agents held 500 such
#: descriptors, which pushed its agents' sockets past the 1,023 that paho's select() can
#: watch (those agents never connected).
MAP_MIN_BYTES = 16 << 20


def _load(path: Path, *, mmap: bool = True) -> np.ndarray | None:
    """A cache file's array, read-only, or None when it cannot be read (cut short or
    emptied by a failing disk, not an array): a damaged file costs its recomputation, not
    the agent. Mapped when ``mmap`` and the file is large (:data:`MAP_MIN_BYTES`)."""
    try:
        mapped = mmap and path.stat().st_size >= MAP_MIN_BYTES
        array = np.load(path, mmap_mode="r" if mapped else None, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    array.flags.writeable = False  # as a read-only map is: the cache is never written through
    return array


def _write_keys(path: Path, keys: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as handle:
        np.save(handle, keys)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def _remove_entry(npy: Path) -> None:
    npy.unlink(missing_ok=True)
    npy.with_suffix(".keys").unlink(missing_ok=True)


def cache_features(
    cache: FeatureCache,
    bundle_id: str,
    data: LocalData,
    runtime: BackboneRuntime,
    *,
    what: str,
) -> np.ndarray:
    return cache.features(
        bundle_id,
        data.images,
        runtime.extract,
        dim=runtime.feature_dim,
        labels=data.labels,
        progress=LoggedProgress(log, what=what, total=len(data)),
    )


def with_cache_dir(settings: Any, path: Any) -> Any:
    from dataclasses import replace

    return settings if settings.cache_dir is not None else replace(settings, cache_dir=path)
