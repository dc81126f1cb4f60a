"""``edge-agent predict``: classify images by the method's inference rule, as the fleet
scores the device; one JSON line per image."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from edge_agent.config import load as load_config
from edge_agent.methods import device_method
from runtime.cliutil import UsageError


def _images(path: Path, size: int):  # type: ignore[no-untyped-def]
    """(name, image as 1 x 3 x H x W float) for each input image, read one at a time so
    that a folder of any size needs the memory of one image; an unreadable file is
    reported as a JSON line in its place."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from edge_agent.data import IMAGE_SUFFIXES, to_nchw_float
    from runtime.npz import read_npz

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


def _batches(images, size: int):  # type: ignore[no-untyped-def]
    """(names, images as B x 3 x H x W) of up to ``size`` consecutive images of one shape."""
    import numpy as np

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
    from edge_agent import inference
    from edge_agent.closed_form import ClosedFormDevice, StoredHead
    from edge_agent.state import StateDir
    from edge_agent.train import LocalModel
    from export.errors import BundleError
    from export.runtime import BackboneRuntime

    cfg = load_config(args.config)
    if not args.input.exists():
        raise UsageError(f"no such input {args.input}")
    if args.batch < 1:
        raise UsageError(f"--batch must be at least 1, got {args.batch}")
    try:
        state = StateDir(cfg.state_dir, agent_id=cfg.agent_id, create=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    rule = inference.rule_of(cfg.method)
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
    rule_name = rule.rule
    if cfg.privacy.mechanism == "dp-features":
        # The rule this device's own validation split chose (edge_agent.anchored), with
        # the model it chose (the head checkpoint): what its rounds were scored by.
        rule_name = next((h["predict_rule"] for h in reversed(state.snapshot.history)
                          if "predict_rule" in h), "classifier")  # fmt: skip
    else:
        try:
            inference.check_references(cfg.method, refs)
        except inference.MissingReference as exc:
            raise UsageError(f"{cfg.method} predicts by {rule.summary}: {exc}") from None
    try:
        runtime = BackboneRuntime(cfg.bundle, settings=cfg.runtime)
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    model = LocalModel(
        in_dim=runtime.feature_dim, num_classes=len(cfg.classes), cfg=cfg.train,
        dual=device_method(cfg.method).dual,
    )  # fmt: skip
    stored = None
    if closed:
        stored = StoredHead.load(cfg.state_dir / ClosedFormDevice.FILE, fleet=cfg.fleet,
                                 feature_dim=runtime.feature_dim, settings=cfg.closed_form,
                                 num_classes=len(cfg.classes))  # fmt: skip
        if stored is None:
            raise UsageError(f"the closed-form head in {cfg.state_dir} does not fit this bundle")
        rule_name = rule.rule
    elif not state.load_model(model):
        raise UsageError(f"no head checkpoint in {cfg.state_dir} that fits this bundle")
    answered = 0
    for names, images in _batches(_images(args.input, cfg.data.image_size), args.batch):
        start = time.perf_counter()
        features = runtime.extract(images)
        if stored is not None:  # a closed-form head: its scores are the logits
            outputs = inference.Outputs(z=features, logits=stored.scores(features))
        else:
            outputs = inference.outputs_of(model, features)
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
