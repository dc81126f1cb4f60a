"""``edge-export bench``: which arms are timed on which device, ratios only within one
device, and a JSON report that parses whatever onnxruntime prints."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from export import architectures, probe, quantize
from export.bench import Arm, _ort_call, headline, plan
from export.cli import main
from export.onnx_io import export_onnx
from export.providers import CPU, CUDA, TENSORRT

CPU_ARMS = [
    Arm("torch", "cpu", "fp32"),
    Arm("ort_fp32", "cpu", "fp32", CPU),
    Arm("ort_int8", "cpu", "int8", CPU),
]


def test_a_cpu_only_machine_times_the_cpu_arms_alone() -> None:
    assert plan([CPU], torch_cuda=False) == CPU_ARMS
    # A torch that sees a GPU changes nothing while ONNX Runtime's CUDA does not work.
    assert plan([CPU], torch_cuda=True) == CPU_ARMS


def test_a_working_cuda_provider_adds_the_same_gpus_arms() -> None:
    assert plan([CUDA, CPU], torch_cuda=True) == [
        *CPU_ARMS,
        Arm("torch", "cuda", "fp32"),
        Arm("ort_fp32", "cuda", "fp32", CUDA),
        Arm("ort_fp16", "cuda", "fp16", CUDA),
    ]
    # onnxruntime-gpu beside a CPU-only torch: no torch figure on the GPU to compare.
    assert Arm("torch", "cuda", "fp32") not in plan([CUDA, CPU], torch_cuda=False)


def test_tensorrt_is_timed_only_where_it_works() -> None:
    arms = plan([TENSORRT, CUDA, CPU], torch_cuda=True)
    assert arms[-1] == Arm("trt_fp16", "cuda", "fp16", TENSORRT)
    assert {a.device for a in arms if a.provider in (CUDA, TENSORRT)} == {"cuda"}
    # Listed but not working (the probe said so): not planned.
    assert not any(a.provider == TENSORRT for a in plan([CUDA, CPU], torch_cuda=True))


def test_bench_json_parses_when_a_listed_provider_fails(monkeypatch, capfd) -> None:
    """onnxruntime-gpu listing TensorRT and CUDA on a machine where neither loads: each
    session asking for them prints onnxruntime's fallback block to stdout."""
    real = ort.InferenceSession

    def session(model: Any, sess_options: Any = None, **kwargs: Any) -> Any:
        providers = kwargs.get("providers") or [CPU]
        if set(providers) & {TENSORRT, CUDA}:
            print("*************** EP Error ***************")
            print(f"EP Error libcudart.so: cannot open shared object file when using {providers}")
            print("Falling back to ['CPUExecutionProvider'] and retrying.")
        return real(model, sess_options, providers=[CPU])

    monkeypatch.setattr(ort, "InferenceSession", session)
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])
    monkeypatch.setattr(probe, "_PROBED", {})
    # int8's error-compensating rounding takes 20 s on two cores and changes nothing this
    # test reads; the quantization itself stays real.
    monkeypatch.setattr(
        quantize, "rounding", SimpleNamespace(collect=lambda *a, **k: None, apply=lambda *a: None)
    )
    code = main(
        ["bench", "cnn32", "--input", "32", "--batches", "1,32", "--min-time", "0.01", "--json"]
    )
    out, _ = capfd.readouterr()
    assert code == 0
    report = json.loads(out)  # nothing but the JSON on stdout
    assert report["providers"] == [TENSORRT, CUDA, CPU] and report["working"] == [CPU]
    assert list(report["batches"]["32"]) == ["cpu"]  # no GPU arm: CUDA did not work
    row = report["batches"]["32"]["cpu"]
    assert row["ort_fp32_vs_torch"] == pytest.approx(row["ort_fp32"] / row["torch"])
    # The flat keys `make bench` records are the CPU's.
    flat = headline(report, "x.")
    assert flat["x.ort_fp32_ips_b32"] == row["ort_fp32"] and flat["x.int8_vs_fp32"] > 0
    assert report["cosine_vs_cpu_fp32"]["cpu"]["ort_int8"]["min"] > 0.9


def test_io_binding_returns_the_same_host_features_as_a_plain_run(tmp_path) -> None:
    """The GPU arms' timed call, run here on the CPU provider (I/O binding is the same
    API there): host arrays in, the bound host arrays out, equal to a plain run."""
    path = tmp_path / "cnn.onnx"
    export_onnx(architectures.build("cnn32").eval(), path, input_shape=(3, 32, 32))
    session = ort.InferenceSession(str(path), providers=[CPU])
    feed = np.random.default_rng(0).normal(size=(4, 3, 32, 32)).astype(np.float32)
    bound = _ort_call([session], [feed], bind=True)
    plain = _ort_call([session], [feed], bind=False)
    first = bound()[0].copy()  # the bound host array, written again by every call
    again = bound()[0]
    assert first.shape == (4, 256) and np.allclose(first, plain()[0], atol=1e-6)
    assert np.allclose(again, first)
