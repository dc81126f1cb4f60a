"""digits-5: five feature-shifted domains of real handwritten digits, made locally.

Built from scikit-learn's bundled 1,797 8x8 digits (no download), upscaled to 32x32 RGB:

- ``clean``: white strokes on black;
- ``inverted``: black strokes on white;
- ``photo``: strokes blended into random patches of scikit-learn's two bundled photos
  (the way MNIST-M is made from MNIST);
- ``colour``: thick (dilated) strokes in random colours on random colours, rotated;
- ``lowres``: downsampled to 12x12 and back, blurred, with Gaussian noise.

Deterministic for a seed.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# torch is imported where the images are made, not here: edge-fleet imports this module
# for its option checks and --help, which should not wait seconds for torch.

DOMAINS = ("clean", "inverted", "photo", "colour", "lowres")
CLASSES = tuple(str(d) for d in range(10))


@cache
def source() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 stroke images (N, 1, 32, 32) and their labels, shared by every domain."""
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8)
    big = nn.functional.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
    return big.clamp(0, 1).numpy(), digits.target.astype(np.int64)


@cache
def _photos() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(np.asarray(img, dtype=np.float32) / 255.0 for img in load_sample_images().images)


def _rotate(x: torch.Tensor, degrees: np.ndarray) -> torch.Tensor:
    import torch
    from torch import nn

    theta = np.deg2rad(degrees)
    cos, sin = np.cos(theta), np.sin(theta)
    mats = torch.tensor(
        np.stack([np.stack([cos, -sin, 0 * cos], 1), np.stack([sin, cos, 0 * cos], 1)], 1),
        dtype=torch.float32,
    )
    grid = nn.functional.affine_grid(mats, list(x.shape), align_corners=False)
    return nn.functional.grid_sample(x, grid, align_corners=False)


def render(domain: str, strokes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(N, 3, 32, 32) float32 in [0, 1] of ``strokes`` (N, 1, 32, 32) in ``domain``."""
    import torch
    from torch import nn

    n = len(strokes)
    s = strokes
    if domain == "clean":
        out = np.repeat(s, 3, axis=1)
    elif domain == "inverted":
        out = 1.0 - np.repeat(s, 3, axis=1)
    elif domain == "photo":
        photos = _photos()
        patches = np.empty((n, 3, 32, 32), np.float32)
        for i in range(n):
            photo = photos[int(rng.integers(len(photos)))]
            top = int(rng.integers(photo.shape[0] - 32))
            left = int(rng.integers(photo.shape[1] - 32))
            patches[i] = photo[top : top + 32, left : left + 32].transpose(2, 0, 1)
        out = np.abs(patches - np.repeat(s, 3, axis=1))  # MNIST-M's blend
    elif domain == "colour":
        dilated = nn.functional.max_pool2d(torch.from_numpy(s), 3, stride=1, padding=1)
        thick = _rotate(dilated, rng.uniform(-30, 30, size=n)).numpy()
        fg = rng.uniform(0, 1, size=(n, 3, 1, 1)).astype(np.float32)
        bg = rng.uniform(0, 1, size=(n, 3, 1, 1)).astype(np.float32)
        flip = np.abs(fg.mean(1) - bg.mean(1))[:, 0, 0] < 0.3  # keep strokes visible
        fg[flip] = 1.0 - bg[flip]
        out = thick * fg + (1 - thick) * bg
    elif domain == "lowres":
        x = torch.from_numpy(np.repeat(s, 3, axis=1))
        small = nn.functional.interpolate(x, size=(12, 12), mode="area")
        x = nn.functional.interpolate(small, size=(32, 32), mode="bilinear", align_corners=False)
        kernel = torch.tensor([1.0, 2.0, 1.0])
        kernel = (kernel[:, None] * kernel[None, :] / 16).expand(3, 1, 3, 3)
        x = nn.functional.conv2d(x, kernel, padding=1, groups=3)
        out = x.numpy() + rng.normal(0, 0.15, size=x.shape).astype(np.float32)
    else:
        raise ValueError(f"unknown domain {domain!r}; use one of {', '.join(DOMAINS)}")
    return np.clip(out, 0, 1).astype(np.float32)


def domain_data(
    domain: str, *, seed: int = 0, indices: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) and labels (N,) of one domain (all 1,797 digits, or
    ``indices`` of them)."""
    strokes, labels = source()
    if indices is not None:
        strokes, labels = strokes[indices], labels[indices]
    rng = np.random.default_rng([seed, DOMAINS.index(domain) if domain in DOMAINS else 99])
    return render(domain, strokes, rng), labels.copy()
