"""Build a bundle from backbone sources, and verify one."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from export import bundle as bundle_mod
from export import ortlog, quantize
from export.bundle import INPUT_NAME, Bundle, Member
from export.errors import BundleError, ExportError
from export.onnx_io import OPSET, compare, export_onnx, onnx_info, torch_features
from export.precision import MIN_FP16_COSINE, cosines
from export.probe import ProbeResult, working_providers
from export.providers import CPU, CUDA, TENSORRT
from export.runtime import preprocess
from export.sources import Loaded
from runtime.version import package_version

log = logging.getLogger(__name__)

#: fp32 must match torch to this absolute error; converted precisions to these cosines.
FP32_MAX_ABS = 1e-4
MIN_COSINE = {"fp16": MIN_FP16_COSINE, "int8": 0.95}


def _ort_features(path: Path, inputs: np.ndarray, *, provider: str = CPU) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    with ortlog.captured(log):
        session = ort.InferenceSession(
            str(path), sess_options=options, providers=list(dict.fromkeys([provider, CPU]))
        )
        outs = [
            session.run(None, {INPUT_NAME: inputs[i : i + 64]})[0]
            for i in range(0, len(inputs), 64)
        ]
    return np.concatenate(outs).astype(np.float32)


def fp16_parity_providers(probes: list[ProbeResult]) -> list[str]:
    """Where an fp16 export is checked against fp32: the CPU provider always, and every
    GPU provider the probe found working here (the CPU provider computes an fp16 graph in
    fp32 between casts, so only a GPU shows what a GPU device will get)."""
    working = {p.provider for p in probes if p.works}
    return [CPU, *(p for p in (CUDA, TENSORRT) if p in working)]


def build(
    loaded: list[Loaded],
    out: Path,
    *,
    images: np.ndarray,
    held_out: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    precision: quantize.Precision = "fp32",
    seed: int = 0,
    extra: dict[str, Any] | None = None,
    fp16_providers: list[str] | None = None,
) -> tuple[Bundle, dict[str, Any]]:
    """Export every backbone into ``out`` at ``precision`` and write the manifest.

    ``images`` (N, 3, H, W) in [0, 1] are real sample inputs, the int8 calibration set;
    ``held_out`` (M, 3, H', W'), images the calibration never saw, are those the parity
    check and the quality report are measured on (``labels`` are theirs). Without
    ``held_out`` every other image of ``images`` is held out and the rest calibrate.

    An fp16 backbone keeps in fp32 the layers whose activations leave fp16's range on
    ``images`` (export/fp16.py), and is refused unless its features on the held-out
    images keep a cosine of :data:`MIN_FP16_COSINE` with fp32 on every provider of
    ``fp16_providers`` (default: the CPU and every GPU provider that works here).
    """
    if precision not in ("fp32", "fp16", "int8"):
        raise ExportError(f"precision must be fp32, fp16 or int8, got {precision!r}")
    if held_out is None:
        images, held_out = images[0::2], images[1::2]
        labels = None if labels is None else labels[1::2]
    if labels is not None and len(labels) != len(held_out):
        raise ExportError(f"{len(labels)} labels for {len(held_out)} held-out images")
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    if precision == "fp16" and fp16_providers is None:
        import onnxruntime as ort

        fp16_providers = fp16_parity_providers(working_providers(ort.get_available_providers()))
    members: list[Member] = []
    report: dict[str, Any] = {
        "precision": precision,
        "calibration_images": len(images),
        "held_out_images": len(held_out),
        "backbones": {},
    }
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for item in loaded:
            src = item.source
            stub = Member(
                name=src.name,
                file="",
                sha256="",
                input_shape=item.input_shape,
                output_dim=0,
                mean=src.mean,
                std=src.std,
            )
            calibration = preprocess(images, stub) if precision == "int8" else None
            real = preprocess(held_out, stub)
            random_inputs = rng.normal(size=(8, *item.input_shape)).astype(np.float32)
            fp32_path = tmp / f"{src.name}.fp32.onnx"
            entry: dict[str, Any] = {}
            if item.module is not None:
                export_onnx(item.module, fp32_path, input_shape=item.input_shape)
                parity_inputs = np.concatenate([random_inputs, real[:8]])
                expected = torch_features(item.module, parity_inputs)
                parity = compare(expected, _ort_features(fp32_path, parity_inputs))
                entry["fp32_vs_torch"] = parity.to_json()
                if parity.max_abs_error > FP32_MAX_ABS:
                    raise ExportError(
                        f"backbone {src.name!r}: ONNX differs from torch by {parity.max_abs_error:.2e} "
                        f"(limit {FP32_MAX_ABS:.0e})"
                    )
            else:
                assert item.onnx is not None
                try:
                    onnx.checker.check_model(str(item.onnx), full_check=True)
                except onnx.checker.ValidationError as exc:
                    raise ExportError(
                        f"backbone {src.name!r}: {item.onnx} fails onnx.checker: {exc}"
                    ) from exc
                shutil.copyfile(item.onnx, fp32_path)
                parity_inputs = np.concatenate([random_inputs, real[:8]])
                expected = _ort_features(
                    fp32_path, parity_inputs
                )  # adopted as is: self-consistency
            final = out / f"{src.name}.{precision}.onnx"
            if precision == "fp32":
                shutil.copyfile(fp32_path, final)
            else:
                if precision == "fp16":
                    try:
                        entry["fp16_fp32_layers"] = quantize.to_fp16(
                            fp32_path, final, samples=preprocess(images[:8], stub)
                        )
                    except ExportError as exc:
                        raise ExportError(f"backbone {src.name!r}: {exc}") from exc
                else:
                    assert calibration is not None
                    quantize.to_int8(
                        fp32_path,
                        final,
                        calibration=calibration,
                        seven_bit_weights=src.seven_bit_weights,
                    )
                    entry["int8_weights"] = {
                        # depthwise convolutions keep 8 (export.quantize.to_int8)
                        "int8_weight_bits": 7 if src.seven_bit_weights else 8,
                        "int8_rounding": "gptq",
                    }
                try:
                    onnx.checker.check_model(str(final), full_check=True)
                except onnx.checker.ValidationError as exc:
                    raise ExportError(
                        f"backbone {src.name!r}: the {precision} model fails onnx.checker: {exc}"
                    ) from exc
                reference = _ort_features(fp32_path, real)
                candidate = _ort_features(final, real)
                cos = compare(reference, candidate)
                entry[f"{precision}_vs_fp32"] = {
                    "on": f"{len(held_out)} held-out images",
                    "mean_cosine": _mean_cosine(reference, candidate),
                    "min_cosine": cos.min_cosine,
                    "prototype_agreement": quantize.prototype_agreement(
                        reference, candidate, labels=labels
                    ),
                }
                if precision == "fp16":
                    entry["fp16_vs_fp32"]["min_cosine_by_provider"] = _fp16_parity(
                        src.name, final, real, reference, fp16_providers or [CPU]
                    )
            shape, dim, opset = onnx_info(final)
            parity_file = f"{src.name}.parity.npz"
            parity_sha = bundle_mod.save_parity(out / parity_file, parity_inputs, expected)
            members.append(
                Member(
                    name=src.name,
                    file=final.name,
                    sha256=bundle_mod.sha256_file(final),
                    input_shape=shape,  # type: ignore[arg-type]
                    output_dim=dim,
                    precision=precision,
                    opset=max(opset, OPSET) if precision == "fp32" else opset,
                    mean=src.mean,
                    std=src.std,
                    parity_file=parity_file,
                    parity_sha256=parity_sha,
                    provenance={**item.provenance, **entry.get("int8_weights", {})},
                )
            )
            report["backbones"][src.name] = entry
    meta = {"created_by": f"protofleet {package_version()}", **(extra or {})}
    bundle = bundle_mod.write_manifest(out, members, extra=meta)
    report["bundle_id"] = bundle.id
    report["feature_dim"] = bundle.feature_dim
    return bundle, report


def _fp16_parity(
    name: str, path: Path, inputs: np.ndarray, reference: np.ndarray, providers: list[str]
) -> dict[str, float]:
    """The fp16 file's lowest feature cosine to fp32 on each provider; refused below
    :data:`MIN_FP16_COSINE` on any."""
    found = {}
    for provider in providers:
        cos = cosines(reference, _ort_features(path, inputs, provider=provider))
        low = float(np.nan if np.isnan(cos).any() else cos.min())
        found[provider] = low
        if not low >= MIN_FP16_COSINE:  # NaN (non-finite or zero features) fails too
            raise ExportError(
                f"backbone {name!r}: its fp16 features on {provider} have a cosine of "
                f"{low:.4f} to fp32 on {len(inputs)} held-out images (at least "
                f"{MIN_FP16_COSINE} is required); build it in fp32"
            )
    return found


def _mean_cosine(a: np.ndarray, b: np.ndarray) -> float:
    num = np.sum(a * b, axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float(np.mean(num / np.maximum(den, 1e-30)))


def verify(path: Path) -> dict[str, Any]:
    """Re-check hashes, onnx.checker and parity of every member. The report's ``ok`` is
    False (and ``problems`` says why, naming files) on any failure."""
    report: dict[str, Any] = {"bundle": str(path), "ok": False, "problems": [], "backbones": {}}
    try:
        bundle = bundle_mod.load(path, check_hashes=False)
    except BundleError as exc:
        report["problems"].append(str(exc))
        return report
    report["bundle_id"] = bundle.id
    report["problems"] += [msg for _, msg in bundle_mod.hash_problems(bundle)]
    broken = {name for name, _ in bundle_mod.hash_problems(bundle)}
    for m in bundle.members:
        entry: dict[str, Any] = {"file": m.file, "precision": m.precision}
        report["backbones"][m.name] = entry
        if m.file in broken or (m.parity_file in broken):
            entry["checked"] = False
            continue
        try:
            onnx.checker.check_model(str(bundle.file(m)), full_check=True)
            entry["onnx_checker"] = "ok"
        except onnx.checker.ValidationError as exc:
            report["problems"].append(f"{m.file}: fails onnx.checker: {exc}")
            continue
        if m.parity_file is None:
            entry["parity"] = "no parity data recorded"
            continue
        inputs, expected = bundle_mod.load_parity(path / m.parity_file)
        parity = compare(expected, _ort_features(bundle.file(m), inputs))
        entry["parity"] = parity.to_json()
        if m.precision == "fp32" and parity.max_abs_error > FP32_MAX_ABS:
            report["problems"].append(
                f"{m.file}: max abs error {parity.max_abs_error:.2e} > {FP32_MAX_ABS:.0e}"
            )
        elif m.precision != "fp32" and parity.min_cosine < MIN_COSINE.get(m.precision, 0.99):
            report["problems"].append(
                f"{m.file}: min cosine {parity.min_cosine:.4f} < {MIN_COSINE[m.precision]}"
            )
    report["ok"] = not report["problems"]
    return report
