"""Natural images made locally for backbones pretrained on photographs (ImageNet).

Rendered glyphs tell little about how an ImageNet model's activations range on photos,
so its int8 calibration and parity checks also use crops of the photographs Python
packages ship (no download): scikit-learn's ``china.jpg`` and ``flower.jpg`` (the
``imagenet`` extra installs scikit-learn) and matplotlib's ``grace_hopper.jpg``.

The two sets share no image: calibration crops come from scikit-learn's two photos and
rendered letters and shapes; the held-out set from Grace Hopper's portrait (a photo the
calibration never saw) and rendered font digits (a task it never saw).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import numpy as np
from PIL import Image

from export import render
from export.errors import ExportError

#: (package, file) of every photo, by name.
PHOTOS = {
    "china": ("sklearn.datasets.images", "china.jpg"),
    "flower": ("sklearn.datasets.images", "flower.jpg"),
    "grace_hopper": ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
}
CALIBRATION_PHOTOS = ("china", "flower")
HELD_OUT_PHOTOS = ("grace_hopper",)


@cache
def photo(name: str) -> np.ndarray:
    """Photo ``name`` as (H, W, 3) float32 in [0, 1]."""
    package, file = PHOTOS[name]
    try:
        source = resources.files(package) / file
        with source.open("rb") as handle:
            image = Image.open(handle).convert("RGB")
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise ExportError(
            f"the photo {file} comes with the {package.split('.')[0]} package, which is not "
            "installed here: pip install 'protofleet[imagenet]'"
        ) from exc
    return np.asarray(image, dtype=np.float32) / 255.0


def available(names: tuple[str, ...]) -> bool:
    try:
        for name in names:
            photo(name)
    except ExportError:
        return False
    return True


def centre_crop(image: np.ndarray, size: int) -> np.ndarray:
    """The largest centred square of an (H, W, 3) image, resized: (3, size, size)."""
    h, w, _ = image.shape
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return _resize(image[top : top + side, left : left + side], size)


def _resize(patch: np.ndarray, size: int) -> np.ndarray:
    img = Image.fromarray(np.round(patch * 255).astype(np.uint8))
    out = img.resize((size, size), Image.Resampling.BICUBIC)
    return (np.asarray(out, dtype=np.float32) / 255.0).transpose(2, 0, 1)


def crops(names: tuple[str, ...], count: int, *, seed: int, size: int = 224) -> np.ndarray:
    """``count`` random crops (N, 3, size, size) of the named photos: a random square of
    15-100% of the shorter side at a random place, mirrored half of the time, its
    brightness and saturation jittered by up to 20%, as ImageNet training crops are."""
    rng = np.random.default_rng(seed)
    out = np.empty((count, 3, size, size), dtype=np.float32)
    for i in range(count):
        image = photo(names[i % len(names)])
        h, w, _ = image.shape
        side = int(min(h, w) * np.sqrt(rng.uniform(0.15, 1.0)))
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        patch = image[top : top + side, left : left + side]
        if rng.random() < 0.5:
            patch = patch[:, ::-1]
        grey = patch.mean(axis=2, keepdims=True)
        patch = grey + (patch - grey) * rng.uniform(0.8, 1.2)  # saturation
        patch = np.clip(patch * rng.uniform(0.8, 1.2), 0.0, 1.0)  # brightness
        out[i] = _resize(patch, size)
    return out


def _rendered(tasks: tuple[str, ...], count: int, *, seed: int, size: int) -> np.ndarray:
    per = [count // len(tasks) + (i < count % len(tasks)) for i in range(len(tasks))]
    return np.concatenate(
        [
            render.render_task(t, n, seed=seed + i, size=size)[0]
            for i, (t, n) in enumerate(zip(tasks, per, strict=True))
        ]
    )


def calibration_set(count: int, *, seed: int = 0, size: int = 224) -> np.ndarray:
    """Half crops of scikit-learn's two photos, half rendered letters and shapes."""
    photos = count // 2
    return np.concatenate(
        [
            crops(CALIBRATION_PHOTOS, photos, seed=seed, size=size),
            _rendered(("letters", "shapes"), count - photos, seed=seed + 100, size=size),
        ]
    )


def held_out_set(count: int, *, seed: int = 0, size: int = 224) -> np.ndarray:
    """Half crops of Grace Hopper's portrait, half rendered font digits: no image, photo
    or task of :func:`calibration_set`."""
    photos = count // 2
    return np.concatenate(
        [
            crops(HELD_OUT_PHOTOS, photos, seed=seed + 1, size=size),
            _rendered(("digits",), count - photos, seed=seed + 200, size=size),
        ]
    )


def sample_sets(side: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(calibration, held out) at ``side`` for a bundle built without ``--samples``: 128
    and 64 images of :func:`calibration_set` and :func:`held_out_set`; rendered images
    only (letters and shapes to calibrate, font digits held out) where the photos'
    packages are not installed."""
    if available(tuple(PHOTOS)):
        return calibration_set(128, seed=seed, size=side), held_out_set(64, seed=seed, size=side)
    return (
        _rendered(("letters", "shapes"), 128, seed=seed + 100, size=side),
        _rendered(("digits",), 64, seed=seed + 200, size=side),
    )


def known_answer_images(size: int = 224) -> tuple[list[str], np.ndarray]:
    """The three photos centre-cropped, plus two fixed crops of each: (names, images)."""
    names, images = [], []
    for name in PHOTOS:
        names.append(name)
        images.append(centre_crop(photo(name), size))
        for j, crop in enumerate(crops((name,), 2, seed=7, size=size)):
            names.append(f"{name}-crop{j}")
            images.append(crop)
    return names, np.stack(images)
