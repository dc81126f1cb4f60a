"""A device's local data: an image folder with one subfolder per class, or an .npz.

Images come out as (N, 3, H, W) float32 in [0, 1], labels as indices into the fleet's
class list. Unreadable images are skipped and counted, never fatal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.npz import NpzError, read_npz

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


class DataError(ValueError):
    """The data cannot be used at all (missing, empty, wrong layout)."""


@dataclass(frozen=True)
class LocalData:
    images: np.ndarray  # (N, 3, H, W) float32 in [0, 1]
    labels: np.ndarray  # (N,) int64 indices into the class list
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count

    def __len__(self) -> int:
        return len(self.labels)


def to_nchw_float(x: np.ndarray, *, source: str) -> np.ndarray:
    """(N, C, H, W) or (N, H, W, C), uint8 or float -> (N, 3, H, W) float32 in [0, 1]."""
    if x.ndim != 4:
        raise DataError(f"{source}: images must be 4-D (N,C,H,W or N,H,W,C), got shape {x.shape}")
    if x.shape[1] not in (1, 3) and x.shape[-1] in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.shape[1] == 1:
        x = np.repeat(x, 3, axis=1)
    if x.shape[1] != 3:
        raise DataError(f"{source}: images need 1 or 3 channels, got shape {x.shape}")
    if x.dtype == np.uint8:
        return x.astype(np.float32) / 255.0
    if not np.issubdtype(x.dtype, np.floating):
        raise DataError(f"{source}: images must be uint8 or float, got {x.dtype}")
    x = x.astype(np.float32)
    if x.size == 0:
        return x
    if not np.isfinite(x).all():
        raise DataError(f"{source}: images contain NaN or Inf")
    if x.min() < 0 or x.max() > 1:
        raise DataError(
            f"{source}: float images must lie in [0, 1] (got {x.min():.3g}..{x.max():.3g})"
        )
    return x


def _map_labels(
    raw: Sequence[object], classes: Sequence[str], *, source: str
) -> tuple[np.ndarray, np.ndarray]:
    """Indices into ``classes`` for each raw label (by name, or an integer index); and a
    mask of the labels that are in the class list."""
    index = {name: i for i, name in enumerate(classes)}
    out = np.full(len(raw), -1, dtype=np.int64)
    for i, label in enumerate(raw):
        value = label.item() if isinstance(label, np.generic) else label
        if str(value) in index:  # a class name (digits "0".."9" match here too)
            out[i] = index[str(value)]
        elif (
            isinstance(value, (int, float))
            and float(value).is_integer()
            and 0 <= value < len(classes)
        ):
            out[i] = int(value)  # an index into the class list
    return out, out >= 0


def _preview(values: Sequence[object], shown: int = 5) -> str:
    head = ", ".join(repr(v) if isinstance(v, str) else str(v) for v in values[:shown])
    return head + (f", ... ({len(values)} in all)" if len(values) > shown else "")


def load_npz(path: Path, classes: Sequence[str]) -> LocalData:
    try:
        data = read_npz(path, required=("x", "y"))
    except NpzError as exc:
        raise DataError(str(exc)) from None
    x, y = data["x"], data["y"]
    if len(x) != len(y):
        raise DataError(f"{path}: {len(x)} images but {len(y)} labels")
    labels, known = _map_labels(list(y), classes, source=str(path))
    if len(y) and not known.any():
        # Say what was expected and what is there: 0.5 or "cat" vs ["0".."9"].
        raise DataError(
            f"{path}: none of its {len(y)} labels is in the fleet's class list; labels are "
            f"class names ({_preview(classes)}) or indices 0-{len(classes) - 1}, and this "
            f"file holds {_preview(np.unique(y).tolist())}"
        )
    skipped = {"unknown_label": int((~known).sum())} if (~known).any() else {}
    images = to_nchw_float(x[known], source=str(path))
    return LocalData(images, labels[known], skipped)


def load_folder(path: Path, classes: Sequence[str], *, size: int = 32) -> LocalData:
    """``path/<class>/*.png`` etc.; images are converted to RGB and resized to ``size``."""
    from PIL import Image, UnidentifiedImageError

    images, labels = [], []
    skipped: dict[str, int] = {}
    index = {name: i for i, name in enumerate(classes)}
    folders = sorted(p for p in path.iterdir() if p.is_dir())
    if not folders:
        raise DataError(f"{path}: no class subfolders (expected {path}/<class>/<image>)")
    for folder in folders:
        if folder.name not in index:
            skipped["unknown_class_folder"] = skipped.get("unknown_class_folder", 0) + 1
            log.warning("skipping folder %s: not in the fleet's class list", folder)
            continue
        for file in sorted(folder.iterdir()):
            if file.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                with Image.open(file) as img:
                    rgb = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
                    images.append(np.asarray(rgb, dtype=np.uint8))
                    labels.append(index[folder.name])
            except (OSError, UnidentifiedImageError, ValueError) as exc:
                skipped["unreadable"] = skipped.get("unreadable", 0) + 1
                log.warning("skipping unreadable image %s: %s", file, exc)
    if not images:
        raise DataError(f"{path}: no readable images in the class folders")
    x = np.stack(images).transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    return LocalData(x, np.asarray(labels, dtype=np.int64), skipped)


def load(path: Path, classes: Sequence[str], *, size: int = 32) -> LocalData:
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    data = load_npz(path, classes) if path.is_file() else load_folder(path, classes, size=size)
    if len(data) == 0:
        raise DataError(f"{path}: no samples with a label in the fleet's class list")
    if data.skipped:
        log.warning("%s: skipped %s", path, ", ".join(f"{n} {k}" for k, n in data.skipped.items()))
    return data
