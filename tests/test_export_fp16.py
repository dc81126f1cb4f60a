"""fp16 where it runs: layers outside fp16's range stay fp32 or the backbone is refused at
export, and a broken fp16 file is refused by the runtime and reported by the doctor."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from edge_agent.cli import main
from export import builder, quantize
from export import bundle as bundle_mod
from export.errors import ExportError
from export.onnx_io import export_onnx
from export.precision import MIN_FP16_COSINE, Fp16Check, cosines
from export.probe import ProbeResult
from export.providers import CPU, CUDA, TENSORRT
from export.runtime import BackboneRuntime, PrecisionRefused
from export.sources import Loaded, Source

SHAPE = (3, 16, 16)


class Scaled(nn.Module):
    """conv -> ReLU -> conv -> mean, L2-normalised; ``scale`` multiplies the first
    convolution's weights and ``gain`` its activations before the second divides it
    back out, so the fp32 features are ordinary whatever the two are."""

    def __init__(self, *, scale: float = 1.0, gain: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 12, 3, padding=1, bias=False)
        with torch.no_grad():
            for param in self.c1.parameters():
                param.mul_(scale)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x)) * self.gain
        h = self.c2(h)
        return nn.functional.normalize(h.mean(dim=(2, 3)), dim=1)  # (B, 12)


def samples(n: int = 16) -> np.ndarray:
    return np.random.default_rng(0).uniform(0, 1, size=(n, *SHAPE)).astype(np.float32)


def loaded(module: nn.Module) -> list[Loaded]:
    return [Loaded(Source(name="net", arch="cnn32"), module.eval(), None, SHAPE, {})]


def test_layers_that_overflow_fp16_stay_in_fp32(tmp_path: Path) -> None:
    fp32 = tmp_path / "net.fp32.onnx"
    export_onnx(Scaled(gain=1e5).eval(), fp32, input_shape=SHAPE)
    x = (samples(8) - 0.5) / 0.5
    kept = quantize.to_fp16(fp32, tmp_path / "net.fp16.onnx", samples=x)
    # The product with the gain (up to ~1e5) and the convolution reading it stay fp32.
    model = onnx.load(str(tmp_path / "net.fp16.onnx"))
    ops = {n.name: n.op_type for n in model.graph.node}
    assert {ops[k] for k in kept} >= {"Mul", "Conv"}, kept
    assert not any("Cast" in k for k in kept)
    untouched = tmp_path / "plain.fp16.onnx"
    assert quantize.to_fp16(Path(fp32), untouched) == []  # no samples: nothing measured


def test_a_backbone_whose_activations_underflow_fp16_is_refused_at_export(
    tmp_path: Path,
) -> None:
    # Activations near 1e-9, as a random-weight EfficientNet-Lite0's are by its head.
    with pytest.raises(ExportError, match=r"backbone 'net': fp16 does not suit this backbone"):
        builder.build(
            loaded(Scaled(scale=1e-9)),
            tmp_path / "b",
            images=samples(),
            precision="fp16",
            fp16_providers=[CPU],
        )
    # The same network at an ordinary scale converts and passes its parity check.
    _, report = builder.build(
        loaded(Scaled()), tmp_path / "ok", images=samples(), precision="fp16", fp16_providers=[CPU]
    )
    entry = report["backbones"]["net"]
    assert entry["fp16_fp32_layers"] == []
    assert entry["fp16_vs_fp32"]["min_cosine_by_provider"][CPU] >= MIN_FP16_COSINE


def test_export_checks_fp16_on_every_gpu_provider_that_works() -> None:
    probes = [ProbeResult(TENSORRT, False, "x"), ProbeResult(CUDA, True, "ok")]
    assert builder.fp16_parity_providers([*probes, ProbeResult(CPU, True, "ok")]) == [CPU, CUDA]
    assert builder.fp16_parity_providers([ProbeResult(CPU, True, "ok")]) == [CPU]


def test_cosines_treat_flushed_and_non_finite_rows_as_failures() -> None:
    ref = np.ones((3, 4), dtype=np.float32)
    cand = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [np.inf, 1, 1, 1]], dtype=np.float32)
    cos = cosines(ref, cand)
    assert cos[0] == pytest.approx(1.0) and np.isnan(cos[1:]).all()
    check = Fp16Check("b", CPU, 3, float("nan"))
    assert not check.ok and "non-finite or all-zero" in check.reason()


@pytest.fixture(scope="module")
def broken_fp16_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle whose fp16 file really is broken: an fp32 backbone with weights near
    1e-9, converted to fp16 without the range check (as any converter would), which
    rounds every weight below fp16's smallest subnormal to +-6e-8."""
    out = tmp_path_factory.mktemp("broken") / "bundle"
    bundle, _ = builder.build(loaded(Scaled(scale=1e-9)), out, images=samples())
    (member,) = bundle.members
    fp16_file = out / "net.fp16.onnx"
    quantize.to_fp16(bundle.file(member), fp16_file)
    (bundle.file(member)).unlink()
    broken = bundle_mod.Member(
        **{
            **member.to_json(),
            "input_shape": member.input_shape,
            "mean": member.mean,
            "std": member.std,
            "file": fp16_file.name,
            "sha256": bundle_mod.sha256_file(fp16_file),
            "precision": "fp16",
        }
    )
    bundle_mod.write_manifest(out, [broken])
    return out


def test_the_runtime_refuses_a_broken_fp16_backbone_and_says_why(broken_fp16_bundle) -> None:
    with pytest.raises(PrecisionRefused) as refused:
        BackboneRuntime(broken_fp16_bundle)
    message = str(refused.value)
    assert message.startswith(f"backbone net: fp16 on {CPU} gives a feature cosine of 0.")
    assert "build the bundle with --precision fp32" in message
    (check,) = refused.value.checks
    assert check.min_cosine < MIN_FP16_COSINE and check.images == 16


def test_a_sound_fp16_backbone_is_checked_and_served(tmp_path: Path) -> None:
    builder.build(
        loaded(Scaled()), tmp_path / "b", images=samples(), precision="fp16", fp16_providers=[CPU]
    )
    runtime = BackboneRuntime(tmp_path / "b")
    check = runtime.fp16_checks["net"]
    assert check.ok and check.provider == CPU and check.min_cosine >= MIN_FP16_COSINE
    assert runtime.fp16_refused == {}


def test_the_doctor_reports_the_refused_fp16_backbone(broken_fp16_bundle, capsys) -> None:

    assert main(["doctor", "--bundle", str(broken_fp16_bundle)]) == 1
    out, err = capsys.readouterr()
    served = json.loads(out)["bundle"]["backbones"]["net"]
    assert served["fp16"]["ok"] is False and served["fp16"]["provider"] == CPU
    assert served["refused"].startswith("backbone net: fp16 on CPUExecutionProvider")
    assert err.strip().splitlines()[-1] == f"edge-agent: doctor: {served['refused']}"
    assert "Traceback" not in err


class TensorRTStandIn:
    """TensorRT as this CPU machine can show it: a session that reports TensorRT and, with
    ``trt_fp16_enable``, computes the model's fp16 conversion for real (on the CPU
    provider), as a TensorRT fp16 engine would; without it, the fp32 model."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.options: list[dict[str, Any]] = []

    def __call__(
        self, model: Any, *, sess_options: Any = None, providers: list[str], provider_options: Any
    ) -> Any:
        import onnxruntime as ort

        opts = dict(zip(providers, provider_options, strict=True)).get(TENSORRT, {})
        if isinstance(model, str):  # a backbone (the probe passes bytes)
            self.options.append(opts)
            if opts.get("trt_fp16_enable"):
                half = self.tmp / f"half{len(self.options)}.onnx"
                quantize.to_fp16(Path(model), half)
                model = str(half)
        session = ort.InferenceSession(model, sess_options=sess_options, providers=[CPU])
        return SimpleNamespace(run=session.run, get_providers=lambda: [TENSORRT, CPU])


def test_tensorrt_fp16_that_breaks_a_backbone_falls_back_to_fp32_engines(tmp_path: Path) -> None:
    bundle, _ = builder.build(loaded(Scaled(scale=1e-9)), tmp_path / "b", images=samples())
    trt = TensorRTStandIn(tmp_path)
    runtime = BackboneRuntime(bundle, available=[TENSORRT, CPU], session_factory=trt)
    assert runtime.active_providers["net"][0] == TENSORRT
    assert runtime.fp16_refused["net"].startswith(f"backbone net: fp16 on {TENSORRT} gives")
    assert [o.get("trt_fp16_enable") for o in trt.options] == [True, False]
    parity = bundle.members[0].parity_file
    assert parity is not None
    inputs, expected = bundle_mod.load_parity(bundle.path / parity)
    x = (inputs[8:] * 0.5) + 0.5  # the held-out half, back to [0, 1] images
    assert cosines(expected[8:], runtime.extract(x)).min() > 0.9999
