"""Source tasks the zoo backbones are pretrained on, rendered locally.

Fonts come from matplotlib's bundled TrueType files, so rendering works on any machine
with the `export` extra and needs no download. None of these tasks uses the handwritten
digits the digits-5 benchmark is made of.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

LETTERS = tuple(string.ascii_uppercase)
DIGITS = tuple(string.digits)
SHAPES = (
    "circle",
    "ring",
    "square",
    "triangle",
    "diamond",
    "pentagon",
    "hexagon",
    "star",
    "cross",
    "bar",
)


@cache
def font_files() -> tuple[Path, ...]:
    """TrueType fonts shipped with matplotlib that cover Latin letters and digits."""
    import matplotlib

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    wanted = ("DejaVu", "STIXGeneral", "cmr10", "cmss10", "cmtt10", "cmb10")
    found = tuple(
        p for p in sorted(folder.glob("*.ttf")) if p.name.startswith(wanted) and _has_glyphs(p)
    )
    if not found:
        raise RuntimeError(f"no bundled fonts found in {folder}")
    return tuple(found)


def _has_glyphs(path: Path) -> bool:
    # Some bundled "Display" faces carry only a few symbols: drop fonts that draw no ink.
    img = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(img).text((4, 4), "A0", fill=255, font=ImageFont.truetype(str(path), 40))
    return bool(np.asarray(img).any())


def _colours(rng: np.random.Generator) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A foreground and background colour with enough contrast to see the symbol."""
    while True:
        fg = rng.integers(0, 256, size=3)
        bg = rng.integers(0, 256, size=3)
        if abs(int(fg.mean()) - int(bg.mean())) > 80:
            return tuple(int(v) for v in fg), tuple(int(v) for v in bg)  # type: ignore[return-value]


def _finish(img: Image.Image, rng: np.random.Generator, size: int) -> np.ndarray:
    if rng.random() < 0.3:
        img = img.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.3, 1.2))))
    arr = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR), dtype=np.float32) / 255.0
    if rng.random() < 0.3:
        arr = arr + rng.normal(0, rng.uniform(0.01, 0.08), size=arr.shape).astype(np.float32)
    return np.clip(arr, 0, 1).transpose(2, 0, 1)  # (3, H, W)


def render_glyph(char: str, rng: np.random.Generator, *, size: int = 32) -> np.ndarray:
    canvas = size * 2  # draw large, then shrink: smoother strokes
    fg, bg = _colours(rng)
    img = Image.new("RGB", (canvas, canvas), bg)
    fonts = font_files()
    font = ImageFont.truetype(
        str(fonts[int(rng.integers(len(fonts)))]), int(rng.uniform(0.55, 0.85) * canvas)
    )
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = draw.textbbox((0, 0), char, font=font)
    x = (canvas - (right - left)) / 2 - left + rng.uniform(-0.12, 0.12) * canvas
    y = (canvas - (bottom - top)) / 2 - top + rng.uniform(-0.12, 0.12) * canvas
    draw.text(
        (x, y), char, fill=fg, font=font, stroke_width=int(rng.integers(0, 3)), stroke_fill=fg
    )
    img = img.rotate(float(rng.uniform(-15, 15)), resample=Image.Resampling.BILINEAR, fillcolor=bg)
    return _finish(img, rng, size)


def _polygon(cx: float, cy: float, r: float, sides: int, phase: float) -> list[tuple[float, float]]:
    return [
        (
            cx + r * math.cos(phase + 2 * math.pi * i / sides),
            cy + r * math.sin(phase + 2 * math.pi * i / sides),
        )
        for i in range(sides)
    ]


def render_shape(shape: str, rng: np.random.Generator, *, size: int = 32) -> np.ndarray:
    canvas = size * 2
    fg, bg = _colours(rng)
    img = Image.new("RGB", (canvas, canvas), bg)
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.22, 0.4) * canvas
    cx = canvas / 2 + rng.uniform(-0.1, 0.1) * canvas
    cy = canvas / 2 + rng.uniform(-0.1, 0.1) * canvas
    phase = rng.uniform(0, 2 * math.pi)
    width = int(rng.integers(2, 6))
    filled = rng.random() < 0.5
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=fg if filled else None, outline=fg, width=width)
    elif shape == "ring":
        draw.ellipse(box, outline=fg, width=max(6, int(r * 0.35)))
    elif shape == "bar":
        pts = _polygon(cx, cy, r, 4, phase)
        half = [
            (cx + (px - cx) * (0.25 if i % 2 else 1.0), cy + (py - cy) * (0.25 if i % 2 else 1.0))
            for i, (px, py) in enumerate(pts)
        ]
        draw.polygon(half, fill=fg)
    elif shape == "cross":
        t = r * 0.3
        for angle in (phase, phase + math.pi / 2):
            dx, dy = math.cos(angle), math.sin(angle)
            arm = [
                (cx - dx * r - dy * t, cy - dy * r + dx * t),
                (cx + dx * r - dy * t, cy + dy * r + dx * t),
                (cx + dx * r + dy * t, cy + dy * r - dx * t),
                (cx - dx * r + dy * t, cy - dy * r - dx * t),
            ]
            draw.polygon(arm, fill=fg)
    elif shape == "star":
        outer = _polygon(cx, cy, r, 5, phase)
        inner = _polygon(cx, cy, r * 0.42, 5, phase + math.pi / 5)
        pts = [p for pair in zip(outer, inner, strict=True) for p in pair]
        draw.polygon(pts, fill=fg if filled else None, outline=fg, width=width)
    else:
        sides = {"square": 4, "triangle": 3, "diamond": 4, "pentagon": 5, "hexagon": 6}[shape]
        if shape == "square":
            phase = math.pi / 4 + rng.uniform(-0.2, 0.2)
        elif shape == "diamond":
            phase = rng.uniform(-0.2, 0.2)
            pts = _polygon(cx, cy, r, 4, phase)
            pts = [
                (cx + (px - cx) * (0.6 if i % 2 else 1.0), cy + (py - cy) * (0.6 if i % 2 else 1.0))
                for i, (px, py) in enumerate(pts)
            ]
            draw.polygon(pts, fill=fg if filled else None, outline=fg, width=width)
            return _finish(img, rng, size)
        draw.polygon(
            _polygon(cx, cy, r, sides, phase), fill=fg if filled else None, outline=fg, width=width
        )
    return _finish(img, rng, size)


def render_task(
    task: str, count: int, *, seed: int, size: int = 32
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """``count`` images (N, 3, size, size) in [0, 1], labels (N,), and the class names of
    source task ``task`` (``letters``, ``shapes`` or ``digits``), balanced over classes."""
    rng = np.random.default_rng(seed)
    draw_one: Callable[..., np.ndarray]
    if task == "letters":
        classes, draw_one = LETTERS, render_glyph
    elif task == "digits":
        classes, draw_one = DIGITS, render_glyph
    elif task == "shapes":
        classes, draw_one = SHAPES, render_shape
    else:
        raise ValueError(f"unknown source task {task!r}; use letters, shapes or digits")
    labels = np.arange(count) % len(classes)
    rng.shuffle(labels)
    images = np.stack([draw_one(classes[y], rng, size=size) for y in labels]).astype(np.float32)
    return images, labels.astype(np.int64), classes
