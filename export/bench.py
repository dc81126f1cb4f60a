"""``edge-export bench``: images per second of torch eager, ONNX Runtime fp32 and int8
(fp16 where a GPU provider supports it), measured side by side in one process."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from export import architectures, quantize, render
from export.bundle import INPUT_NAME, Bundle
from export.onnx_io import export_onnx
from export.runtime import CPU, choose_providers, quiet_threads
from export.sources import PRETRAINED
from export.timing import seconds_per_call


@dataclass
class Target:
    """One backbone to time. ``onnx`` is its fp32 file when it has trained weights (a
    bundle member): ONNX Runtime runs and quantizes that file, so the int8 cosine is
    measured on the real weights, while torch eager runs the same architecture."""

    name: str
    module: nn.Module
    input_shape: tuple[int, int, int]
    onnx: Path | None = None
    seven_bit_weights: bool = False  # int8 as the member's own export quantizes it


def targets_for_bundle(bundle: Bundle) -> list[Target]:
    """Rebuild each member's architecture from its provenance (same compute, any weights)."""
    out = []
    for m in bundle.members:
        arch = m.provenance.get("architecture")
        if arch is None:
            raise ValueError(
                f"backbone {m.name} records no architecture; bench it by architecture name instead"
            )
        kwargs = dict(m.provenance.get("arch_kwargs", {}))
        fp32 = bundle.file(m) if m.precision == "fp32" else None
        preset = PRETRAINED.get(m.provenance.get("pretrained", ""))
        model = architectures.build(arch, **kwargs).eval()
        seven = preset is not None and preset.seven_bit_weights
        out.append(Target(m.name, model, m.input_shape, fp32, seven_bit_weights=seven))
    return out


def targets_for_arch(arch: str, input_size: int) -> list[Target]:
    model = architectures.build(arch, input_size=input_size).eval()
    return [Target(arch, model, (3, input_size, input_size))]


def _images(shape: tuple[int, int, int], count: int) -> np.ndarray:
    """Real rendered images (letters and shapes) at the target's size, normalised."""
    x = np.concatenate(
        [
            render.render_task("letters", count // 2, seed=7)[0],
            render.render_task("shapes", count - count // 2, seed=8)[0],
        ]
    )
    if x.shape[2:] != shape[1:]:
        x = torch.nn.functional.interpolate(
            torch.from_numpy(x), size=shape[1:], mode="bilinear", antialias=True
        ).numpy()
    return np.ascontiguousarray((x - 0.5) / 0.5, dtype=np.float32)


def run(
    targets: list[Target], *, batches: tuple[int, ...] = (1, 32), min_time: float = 0.5
) -> dict[str, Any]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    quiet_threads(options)
    available = ort.get_available_providers()
    gpu = [p for p, _ in choose_providers(available) if p != CPU]
    results: dict[str, Any] = {"providers": available, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        sessions: dict[str, list[Any]] = {"fp32": [], "int8": [], "fp16": []}
        calib = {}
        for t in targets:
            calib[t.name] = _images(t.input_shape, 64)
            fp32, int8 = t.onnx or tmp / f"{t.name}.fp32.onnx", tmp / f"{t.name}.int8.onnx"
            if t.onnx is None:
                export_onnx(t.module, fp32, input_shape=t.input_shape)
            quantize.to_int8(
                fp32, int8, calibration=calib[t.name], seven_bit_weights=t.seven_bit_weights
            )
            sessions["fp32"].append(ort.InferenceSession(str(fp32), options, providers=[CPU]))
            sessions["int8"].append(ort.InferenceSession(str(int8), options, providers=[CPU]))
            if gpu:
                fp16 = tmp / f"{t.name}.fp16.onnx"
                quantize.to_fp16(fp32, fp16)
                sessions["fp16"].append(
                    ort.InferenceSession(str(fp16), options, providers=[*gpu, CPU])
                )

        def ort_call(kind: str, batch: int) -> Any:
            feeds = [np.resize(calib[t.name], (batch, *t.input_shape)) for t in targets]
            return lambda: [
                s.run(None, {INPUT_NAME: f}) for s, f in zip(sessions[kind], feeds, strict=True)
            ]

        def torch_call(batch: int) -> Any:
            feeds = [
                torch.from_numpy(np.resize(calib[t.name], (batch, *t.input_shape))) for t in targets
            ]

            def call() -> None:
                with torch.inference_mode():
                    for t, f in zip(targets, feeds, strict=True):
                        t.module(f)

            return call

        for batch in batches:
            row = {
                "torch": batch / seconds_per_call(torch_call(batch), repeat=3, min_time=min_time)
            }
            for kind in ("fp32", "int8", "fp16"):
                if sessions[kind]:
                    row[f"ort_{kind}"] = batch / seconds_per_call(
                        ort_call(kind, batch), repeat=3, min_time=min_time
                    )
            row["ort_fp32_vs_torch"] = row["ort_fp32"] / row["torch"]
            row["int8_vs_fp32"] = row["ort_int8"] / row["ort_fp32"]
            results["batches"][str(batch)] = row
        if not gpu:
            results["fp16"] = (
                "skipped: no GPU execution provider here (fp16 on the CPU provider is emulated and slower)"
            )
        cosines = []
        for t, s32, s8 in zip(targets, sessions["fp32"], sessions["int8"], strict=True):
            a = s32.run(None, {INPUT_NAME: calib[t.name]})[0]
            b = s8.run(None, {INPUT_NAME: calib[t.name]})[0]
            cosines.append(
                np.sum(a * b, axis=1)
                / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)
            )
        results["int8_cosine"] = float(np.mean(np.concatenate(cosines)))
    return results


def headline(results: dict[str, Any], prefix: str) -> dict[str, float]:
    """The flat keys ``make bench`` records (batch 32)."""
    row = results["batches"]["32"]
    return {
        f"{prefix}ort_fp32_vs_torch": row["ort_fp32_vs_torch"],
        f"{prefix}int8_vs_fp32": row["int8_vs_fp32"],
        f"{prefix}int8_cosine": results["int8_cosine"],
        f"{prefix}torch_ips_b32": row["torch"],
        f"{prefix}ort_fp32_ips_b32": row["ort_fp32"],
        f"{prefix}ort_int8_ips_b32": row["ort_int8"],
        f"{prefix}ort_fp32_ips_b1": results["batches"]["1"]["ort_fp32"],
    }
