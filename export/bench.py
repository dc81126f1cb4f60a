"""``edge-export bench``: images per second of torch eager, ONNX Runtime fp32 and int8 on
the CPU and, where a GPU provider works, torch, ONNX Runtime fp32 and fp16 and TensorRT
fp16 on the same GPU, measured side by side in one process, each labelled with its
device, from host arrays to host arrays."""

from __future__ import annotations

import copy
import logging
import platform
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from export import architectures, ortlog, quantize, render
from export.bundle import INPUT_NAME, Bundle
from export.errors import ExportError
from export.onnx_io import export_onnx
from export.precision import cosines
from export.probe import working_providers
from export.providers import CPU, CUDA, TENSORRT
from export.runtime import quiet_threads
from export.sources import PRETRAINED
from export.timing import seconds_per_call

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Arm:
    """One way of running the targets, timed from host arrays to host arrays."""

    name: str  # the key of its figures: torch, ort_fp32, ort_int8, ort_fp16, trt_fp16
    device: str  # "cpu" or "cuda": ratios are only ever taken within one device
    precision: str  # fp32, int8 or fp16
    provider: str | None = None  # the ONNX Runtime provider; None: torch eager


#: Ratios reported for each device, as (name, arm, baseline arm), each where both ran.
RATIOS = (
    ("ort_fp32_vs_torch", "ort_fp32", "torch"),
    ("int8_vs_fp32", "ort_int8", "ort_fp32"),
    ("fp16_vs_fp32", "ort_fp16", "ort_fp32"),
    ("trt_fp16_vs_ort_fp32", "trt_fp16", "ort_fp32"),
)


def plan(working: Sequence[str], *, torch_cuda: bool, int8: bool = True) -> list[Arm]:
    """The arms to time, given the providers the probe found working and whether torch
    sees a CUDA device: the CPU's as ever (torch, ONNX Runtime fp32 and int8), and on a
    working CUDA provider the same GPU's torch, ONNX Runtime fp32 and fp16, and
    TensorRT fp16 where TensorRT works too. fp16 on the CPU provider is not timed: it
    computes in fp32 between casts, and is slower. ``int8=False`` leaves int8 out (its
    quantization takes minutes for a large backbone)."""
    arms = [Arm("torch", "cpu", "fp32"), Arm("ort_fp32", "cpu", "fp32", CPU)]
    if int8:
        arms.append(Arm("ort_int8", "cpu", "int8", CPU))
    if CUDA in working:
        if torch_cuda:
            arms.append(Arm("torch", "cuda", "fp32"))
        arms += [Arm("ort_fp32", "cuda", "fp32", CUDA), Arm("ort_fp16", "cuda", "fp16", CUDA)]
        if TENSORRT in working:
            arms.append(Arm("trt_fp16", "cuda", "fp16", TENSORRT))
    return arms


def _ort_call(
    sessions: list[Any], feeds: list[np.ndarray], *, bind: bool
) -> Callable[[], list[np.ndarray]]:
    """A call sending one batch through every target's session, host arrays in and host
    arrays (the features) out. With ``bind`` (on a GPU) the output is bound to a host
    array of the right shape (ONNX Runtime's I/O binding), so the copy back from the
    device lands there directly instead of in a new array each call."""
    if not bind:
        return lambda: [
            s.run(None, {INPUT_NAME: f})[0] for s, f in zip(sessions, feeds, strict=True)
        ]
    import onnxruntime as ort

    bindings = []
    for session, feed in zip(sessions, feeds, strict=True):
        (output,) = session.get_outputs()
        binding = session.io_binding()
        host = None
        if isinstance(output.shape[1], int):
            host = np.empty((len(feed), output.shape[1]), dtype=np.float32)
            binding.bind_ortvalue_output(output.name, ort.OrtValue.ortvalue_from_numpy(host))
        else:  # a symbolic feature size: ONNX Runtime allocates the host array
            binding.bind_output(output.name, "cpu")
        bindings.append((session, binding, feed, host))

    def call() -> list[np.ndarray]:
        out = []
        for session, binding, feed, host in bindings:
            binding.bind_cpu_input(INPUT_NAME, feed)  # copied to the GPU inside the run
            session.run_with_iobinding(binding)
            out.append(host if host is not None else binding.copy_outputs_to_cpu()[0])
        return out

    return call


def _torch_call(modules: list[nn.Module], feeds: list[np.ndarray], device: str) -> Any:
    inputs = [torch.from_numpy(f) for f in feeds]

    def call() -> None:
        with torch.inference_mode():
            for module, x in zip(modules, inputs, strict=True):
                module(x.to(device)).cpu()  # host in, host out, as the agent holds them

    return call


def _open(path: Path, options: Any, arm: Arm) -> Any:
    import onnxruntime as ort

    assert arm.provider is not None
    chain: list[tuple[str, dict[str, Any]]] = [(arm.provider, {})]
    if arm.provider == TENSORRT:
        chain = [(TENSORRT, {"trt_fp16_enable": True}), (CUDA, {})]
    try:
        with ortlog.captured(log):
            session = ort.InferenceSession(
                str(path),
                options,
                providers=[p for p, _ in chain],
                provider_options=[o for _, o in chain],
            )
    except (ValueError, RuntimeError) as exc:  # onnxruntime's errors for a provider
        raise ExportError(f"{arm.provider} could not open the model: {exc}") from exc
    kept = session.get_providers()[0]
    if kept != arm.provider:
        raise ExportError(f"{arm.provider} fell back to {kept}")
    return session


def run(
    targets: list[Target],
    *,
    batches: tuple[int, ...] = (1, 32),
    min_time: float = 0.5,
    working: Sequence[str] | None = None,
    torch_cuda: bool | None = None,
    int8: bool = True,
) -> dict[str, Any]:
    """Images per second of every arm of :func:`plan` at each batch size, the ratios
    within each device, and every arm's feature cosine to fp32 on the CPU provider.
    ``working`` defaults to the providers the probe finds working here."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    quiet_threads(options)
    available = ort.get_available_providers()
    if working is None:
        working = [p.provider for p in working_providers(available) if p.works]
    if torch_cuda is None:
        torch_cuda = torch.cuda.is_available()
    arms = plan(working, torch_cuda=torch_cuda, int8=int8)
    results: dict[str, Any] = {
        "providers": available,
        "working": list(working),
        "devices": {"cpu": cpu_model()},
        "batches": {},
        "cosine_vs_cpu_fp32": {},
        "skipped": {},
    }
    if any(a.device == "cuda" for a in arms):
        results["devices"]["cuda"] = torch.cuda.get_device_name(0) if torch_cuda else "CUDA device"
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        calib = {t.name: _images(t.input_shape, 64) for t in targets}
        files: dict[str, list[Path]] = {"fp32": [], "int8": [], "fp16": []}
        for t in targets:
            fp32 = t.onnx or tmp / f"{t.name}.fp32.onnx"
            if t.onnx is None:
                export_onnx(t.module, fp32, input_shape=t.input_shape)
            files["fp32"].append(fp32)
            if int8:
                quantized = tmp / f"{t.name}.int8.onnx"
                quantize.to_int8(
                    fp32,
                    quantized,
                    calibration=calib[t.name],
                    seven_bit_weights=t.seven_bit_weights,
                )
                files["int8"].append(quantized)
        sessions: dict[Arm, list[Any]] = {}
        for arm in arms:
            if arm.provider is None:
                continue
            try:
                if arm.precision == "fp16" and arm.provider != TENSORRT and not files["fp16"]:
                    for t, fp32 in zip(targets, files["fp32"], strict=True):
                        fp16 = tmp / f"{t.name}.fp16.onnx"
                        quantize.to_fp16(fp32, fp16, samples=calib[t.name][:8])
                        files["fp16"].append(fp16)
                kind = "fp32" if arm.provider == TENSORRT else arm.precision
                sessions[arm] = [_open(f, options, arm) for f in files[kind]]
            except ExportError as exc:  # fp16 refused, or a provider that fell back
                results["skipped"][f"{arm.device}.{arm.name}"] = str(exc)
        modules = {
            "cpu": [t.module for t in targets],
            "cuda": [copy.deepcopy(t.module).to("cuda") for t in targets]
            if torch_cuda and any(a.device == "cuda" and a.provider is None for a in arms)
            else [],
        }

        for batch in batches:
            feeds = [np.resize(calib[t.name], (batch, *t.input_shape)) for t in targets]
            rows: dict[str, dict[str, float]] = {}
            for arm in arms:
                if arm.provider is None:
                    call = _torch_call(modules[arm.device], feeds, arm.device)
                elif arm in sessions:
                    call = _ort_call(sessions[arm], feeds, bind=arm.device != "cpu")
                else:
                    continue
                seconds = seconds_per_call(call, repeat=3, min_time=min_time)
                rows.setdefault(arm.device, {})[arm.name] = batch / seconds
            for row in rows.values():
                for name, arm_name, baseline in RATIOS:
                    if arm_name in row and baseline in row:
                        row[name] = row[arm_name] / row[baseline]
            results["batches"][str(batch)] = rows

        reference = [
            s.run(None, {INPUT_NAME: calib[t.name]})[0]
            for t, s in zip(targets, sessions[arms[1]], strict=True)
        ]
        for arm, arm_sessions in sessions.items():
            if arm == arms[1]:
                continue
            cos = np.concatenate(
                [
                    cosines(ref, s.run(None, {INPUT_NAME: calib[t.name]})[0])
                    for t, s, ref in zip(targets, arm_sessions, reference, strict=True)
                ]
            )
            results["cosine_vs_cpu_fp32"].setdefault(arm.device, {})[arm.name] = {
                "mean": float(np.nanmean(cos)) if not np.isnan(cos).all() else None,
                "min": None if np.isnan(cos).any() else float(cos.min()),
            }
        for module in modules["cuda"]:
            cos = np.concatenate(
                [
                    cosines(ref, _torch_features(module, calib[t.name]))
                    for t, ref in zip(targets, reference, strict=True)
                ]
            )
            results["cosine_vs_cpu_fp32"].setdefault("cuda", {})["torch"] = {
                "mean": float(np.mean(cos)),
                "min": float(np.min(cos)),
            }
            break
        if int8:
            results["int8_cosine"] = results["cosine_vs_cpu_fp32"]["cpu"]["ort_int8"]["mean"]
    return results


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it, else what Python knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_features(module: nn.Module, x: np.ndarray) -> np.ndarray:
    device = next(module.parameters()).device
    with torch.inference_mode():
        return module(torch.from_numpy(x).to(device)).cpu().numpy()


def headline(results: dict[str, Any], prefix: str) -> dict[str, float]:
    """The flat keys ``make bench`` records (batch 32)."""
    row = results["batches"]["32"]["cpu"]
    return {
        f"{prefix}ort_fp32_vs_torch": row["ort_fp32_vs_torch"],
        f"{prefix}int8_vs_fp32": row["int8_vs_fp32"],
        f"{prefix}int8_cosine": results["int8_cosine"],
        f"{prefix}torch_ips_b32": row["torch"],
        f"{prefix}ort_fp32_ips_b32": row["ort_fp32"],
        f"{prefix}ort_int8_ips_b32": row["ort_int8"],
        f"{prefix}ort_fp32_ips_b1": results["batches"]["1"]["cpu"]["ort_fp32"],
    }
