"""``edge-agent predict``: classify images by the method's inference rule, as the fleet
scores the device; one JSON line per image."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from edge_agent import inference
from edge_agent.closed_form import ClosedFormDevice
from edge_agent.config import load as load_config
from edge_agent.data import IMAGE_SUFFIXES, to_nchw_float
from edge_agent.methods import device_method
from edge_agent.state import StateDir
from export.errors import BundleError
from export.runtime import BackboneRuntime
from runtime.cliutil import UsageError
from runtime.npz import read_npz


def _images(path: Path, size: int) -> Iterator[tuple[str, np.ndarray]]:
    """(name, image as 1 x 3 x H x W float) for each input image, read one at a time so
    that a folder of any size needs the memory of one image; an unreadable file is
    reported as a JSON line in its place."""
    from PIL import Image, UnidentifiedImageError  # as in edge_agent.data: not for --help

    try:
        if path.is_file() and path.suffix == ".npz":
            x = read_npz(path, required=("x",))["x"]
            if x.ndim != 4:  # checked whole: a row's shape would misstate the file's
                raise UsageError(f"{path}: x must be 4-D (N,C,H,W or N,H,W,C), got {x.shape}")
            for i in range(len(x)):
                yield f"{path.name}[{i}]", to_nchw_float(x[i : i + 1], source=str(path))
            return
        # A folder is searched through its subfolders too: a tree of class folders, laid
        # out as for training, is a natural thing to point at.
        files = (
            sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if path.is_dir()
            else [path]
        )
        for file in files:
            try:
                with Image.open(file) as img:
                    rgb = np.asarray(img.convert("RGB").resize((size, size)), dtype=np.uint8)
            except (OSError, UnidentifiedImageError) as exc:
                print(json.dumps({"input": str(file), "error": f"unreadable: {exc}"}))
                continue
            yield str(file), to_nchw_float(rgb[None], source=str(file))
    except ValueError as exc:  # NpzError, or DataError for images of the wrong shape
        raise UsageError(str(exc)) from None


def _batches(
    images: Iterable[tuple[str, np.ndarray]], size: int
) -> Iterator[tuple[list[str], np.ndarray]]:
    """(names, images as B x 3 x H x W) of up to ``size`` consecutive images of one shape."""
    names: list[str] = []
    parts: list[np.ndarray] = []
    for name, image in images:
        if parts and (len(names) == size or image.shape[1:] != parts[0].shape[1:]):
            yield names, np.concatenate(parts)
            names, parts = [], []
        names.append(name)
        parts.append(image)
    if names:
        yield names, np.concatenate(parts)


def cmd_predict(args: argparse.Namespace) -> int:
    # Here, not at the top: the model is torch's, and `edge-agent --help` must not load it.
    from edge_agent import predictor

    cfg = load_config(args.config)
    if not args.input.exists():
        raise UsageError(f"no such input {args.input}")
    if args.batch < 1:
        raise UsageError(f"--batch must be at least 1, got {args.batch}")
    try:
        state = StateDir(cfg.state_dir, agent_id=cfg.agent_id, create=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    refs = inference.stored_references(state)
    closed = not device_method(cfg.method).trains_head
    if closed and not (cfg.state_dir / ClosedFormDevice.FILE).exists():
        raise UsageError(
            f"no closed-form head in {cfg.state_dir} yet: the coordinator has announced none"
        )
    if state.load_prototypes() is None:
        raise UsageError(
            f"no prototypes in {cfg.state_dir} yet: the agent has not answered a round"
        )
    try:
        rule_name = predictor.rule_for(cfg, state, refs)
        runtime = BackboneRuntime(cfg.bundle, settings=cfg.runtime)
        outputs_of = predictor.outputs_for(cfg, state, feature_dim=runtime.feature_dim)
    except (predictor.PredictorError, BundleError) as exc:
        raise UsageError(str(exc)) from exc
    answered = 0
    for names, images in _batches(_images(args.input, cfg.data.image_size), args.batch):
        start = time.perf_counter()
        outputs = outputs_of(runtime.extract(images))
        # The function the simulated fleet scores this device with.
        chosen = inference.RULES[rule_name](outputs, refs)
        latency = (time.perf_counter() - start) * 1e3 / len(names)
        for i, name in enumerate(names):
            print(
                json.dumps(
                    {
                        "input": name,
                        "class": cfg.classes[int(chosen.classes[i])],
                        "score": round(float(chosen.scores[i]), 5),
                        "rule": rule_name,
                        "latency_ms": round(latency, 3),
                    }
                )
            )
        answered += len(names)
    if not answered:
        raise UsageError(f"no readable images in {args.input}")
    return 0
