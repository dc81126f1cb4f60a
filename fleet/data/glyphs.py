"""glyphs-5: a small feature-shifted data set of rendered Greek letters, made locally.

A second benchmark, built differently from digits-5 (handwritten digits under image
transforms): ten lowercase Greek letters, none of them a class the zoo's backbones were
pretrained on (uppercase Latin letters, font digits, geometric shapes), rendered from
matplotlib's bundled fonts. Each of five clients holds one domain, a typeface and a way of
drawing it:

- ``ink``: DejaVu Serif, dark ink on light paper with paper grain;
- ``neon``: DejaVu Sans Bold, a bright colour on a dark background, with a glow;
- ``outline``: DejaVu Sans Mono, the letter's outline only, on a mid-grey background;
- ``stripes``: STIX, the letter cut out of a striped pattern on a pattern at another angle;
- ``faded``: DejaVu Sans Oblique, low contrast, downsampled and noisy, rotated further.

Each image varies in size, position, rotation and colours. Written as an .npz of clients
for ``--data`` (``train_x_<i>``, ``train_y_<i>``, ``test_x_<i>``, ``test_y_<i>``,
``domain_<i>``, x uint8 N,3,32,32). Deterministic for a seed. No download.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from runtime.cliutil import UsageError
from runtime.files import atomic_write

CLASSES = ("alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "mu", "pi", "sigma")
LETTERS = "αβγδεθλμπσ"
DOMAINS = ("ink", "neon", "outline", "stripes", "faded")
FONTS = {
    "ink": "DejaVuSerif.ttf",
    "neon": "DejaVuSans-Bold.ttf",
    "outline": "DejaVuSansMono.ttf",
    "stripes": "STIXGeneral.ttf",
    "faded": "DejaVuSans-Oblique.ttf",
}
SIZE = 32
_CANVAS = 2 * SIZE  # drawn large, then shrunk: smoother strokes

Image_ = Any  # PIL.Image.Image, imported where images are made


@cache
def _font_file(domain: str) -> str:
    import matplotlib

    path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / FONTS[domain]
    if not path.exists():
        raise RuntimeError(f"the bundled font {path} is missing")
    return str(path)


def _letter_mask(letter: str, domain: str, rng: np.random.Generator, *, stroke: int = 0) -> Image_:
    """The letter as a greyscale mask on the large canvas, jittered in size, place and
    angle."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(_font_file(domain), int(rng.uniform(0.5, 0.8) * _CANVAS))
    mask = Image.new("L", (_CANVAS, _CANVAS), 0)
    draw = ImageDraw.Draw(mask)
    left, top, right, bottom = draw.textbbox((0, 0), letter, font=font, stroke_width=stroke)
    x = (_CANVAS - (right - left)) / 2 - left + rng.uniform(-0.1, 0.1) * _CANVAS
    y = (_CANVAS - (bottom - top)) / 2 - top + rng.uniform(-0.1, 0.1) * _CANVAS
    draw.text((x, y), letter, fill=255, font=font, stroke_width=stroke, stroke_fill=255)
    turn = 35.0 if domain == "faded" else 15.0
    return mask.rotate(float(rng.uniform(-turn, turn)), resample=Image.Resampling.BILINEAR)


def _alpha(mask: Image_) -> np.ndarray:
    return np.asarray(mask, dtype=np.float32)[..., None] / 255.0  # (H, W, 1)


def _colour(rng: np.random.Generator, low: int, high: int) -> np.ndarray:
    return rng.integers(low, high, size=3).astype(np.float32)


def _ink(letter: str, rng: np.random.Generator) -> np.ndarray:
    a = _alpha(_letter_mask(letter, "ink", rng))
    paper = _colour(rng, 200, 256) + rng.normal(0, 8, size=(_CANVAS, _CANVAS, 1))
    return paper * (1 - a) + _colour(rng, 0, 70) * a


def _neon(letter: str, rng: np.random.Generator) -> np.ndarray:
    from PIL import ImageFilter

    mask = _letter_mask(letter, "neon", rng)
    glow = _alpha(mask.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(2, 5)))))
    a = np.maximum(_alpha(mask), 0.7 * glow)
    return _colour(rng, 0, 50) * (1 - a) + _colour(rng, 150, 256) * a


def _outline(letter: str, rng: np.random.Generator) -> np.ndarray:
    stroke = int(rng.integers(2, 4))
    seed = rng.integers(1 << 32)  # the same jitter twice: the outline is outer minus inner
    outer = _alpha(_letter_mask(letter, "outline", np.random.default_rng(seed), stroke=stroke))
    inner = _alpha(_letter_mask(letter, "outline", np.random.default_rng(seed)))
    a = np.clip(outer - inner, 0, 1)
    return _colour(rng, 100, 160) * (1 - a) + _colour(rng, 0, 256) * a


def _stripes(letter: str, rng: np.random.Generator) -> np.ndarray:
    a = _alpha(_letter_mask(letter, "stripes", rng, stroke=2))  # thick enough to hold stripes
    yy, xx = np.mgrid[0:_CANVAS, 0:_CANVAS].astype(np.float32)

    def pattern(angle: float, period: float) -> np.ndarray:
        along = xx * np.cos(angle) + yy * np.sin(angle)
        return (0.5 + 0.5 * np.sin(2 * np.pi * along / period))[..., None]

    first = float(rng.uniform(0, np.pi))
    # A low-contrast pattern behind a letter cut from a high-contrast one at right angles.
    mid = _colour(rng, 70, 190)
    background = mid + (pattern(first, float(rng.uniform(6, 10))) - 0.5) * 50
    fg = pattern(first + np.pi / 2, float(rng.uniform(3, 5)))
    foreground = _colour(rng, 180, 256) * fg + _colour(rng, 0, 60) * (1 - fg)
    return background * (1 - a) + foreground * a


def _faded(letter: str, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image

    a = _alpha(_letter_mask(letter, "faded", rng))
    base = _colour(rng, 60, 200)
    img = base * (1 - a) + (base + rng.choice([-1, 1]) * rng.uniform(40, 70)) * a
    small = int(rng.integers(11, 16))
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    img = np.asarray(
        pil.resize((small, small), Image.Resampling.BILINEAR).resize(
            (_CANVAS, _CANVAS), Image.Resampling.BILINEAR
        ),
        dtype=np.float32,
    )
    return img + rng.normal(0, 12, size=img.shape)


STYLES: dict[str, Callable[[str, np.random.Generator], np.ndarray]] = {
    "ink": _ink,
    "neon": _neon,
    "outline": _outline,
    "stripes": _stripes,
    "faded": _faded,
}


def render(letter: str, domain: str, rng: np.random.Generator) -> np.ndarray:
    """One image (3, 32, 32) uint8."""
    from PIL import Image

    big = np.clip(STYLES[domain](letter, rng), 0, 255).astype(np.uint8)  # (64, 64, 3)
    small = Image.fromarray(big).resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(small, dtype=np.uint8).transpose(2, 0, 1)


def make(*, seed: int = 0, train: int = 100, test: int = 100) -> dict[str, np.ndarray]:
    """The clients' arrays, one client per domain, classes balanced (``train`` and
    ``test`` images per client, split as evenly over the ten classes as they divide)."""
    if train < len(CLASSES) or test < 1:
        raise ValueError(f"train must be at least {len(CLASSES)} and test at least 1")
    arrays: dict[str, np.ndarray] = {}
    for i, domain in enumerate(DOMAINS):
        rng = np.random.default_rng([seed, i])
        for part, n in (("train", train), ("test", test)):
            y = rng.permutation(np.arange(n) % len(CLASSES)).astype(np.int64)
            arrays[f"{part}_x_{i}"] = np.stack([render(LETTERS[c], domain, rng) for c in y])
            arrays[f"{part}_y_{i}"] = y
        arrays[f"domain_{i}"] = np.array(domain)
    return arrays


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "glyphs",
        help="write glyphs-5, a second feature-shifted benchmark (rendered Greek letters), "
        "as an .npz for --data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="the .npz to write")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument("--train", type=int, default=100, help="training images per client")
    parser.add_argument("--test", type=int, default=100, help="test images per client")


def main(args: argparse.Namespace) -> int:
    if args.out.suffix != ".npz":
        raise UsageError(f"--out must name an .npz file, got {args.out}")
    try:
        arrays = make(seed=args.seed, train=args.train, test=args.test)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)  # type: ignore[arg-type]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, buffer.getvalue())
    print(f"wrote {args.out}: {len(DOMAINS)} clients ({', '.join(DOMAINS)}), "
          f"{len(CLASSES)} classes, {args.train} training and {args.test} test images each")  # fmt: skip
    return 0
