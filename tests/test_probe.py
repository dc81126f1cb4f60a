"""The provider probe: the embedded model is what it claims, CPU runs it, and a provider
that falls back or fails is reported as not working."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export import probe
from export.probe import PROBE_MODEL, probe_providers
from export.runtime import CPU, CUDA, TENSORRT, BackboneRuntime


def test_embedded_model_is_the_documented_matmul() -> None:
    w = numpy_helper.from_array(np.arange(32, dtype=np.float32).reshape(8, 4) / 32, name="w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [w],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="protofleet"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    assert model.SerializeToString() == PROBE_MODEL


def test_cpu_runs_the_probe_for_real() -> None:
    (result,) = probe_providers([CPU])
    assert result.provider == CPU and result.works, result


class FakeSession:
    """What onnxruntime does on a Jetson whose CUDA libraries do not load: the session is
    created, runs on the CPU, and reports only the CPU provider."""

    def __init__(
        self,
        model: bytes,
        *,
        sess_options: Any = None,
        providers: list[str],
        provider_options: list[dict[str, Any]],
    ) -> None:
        if providers[0] == TENSORRT:
            raise RuntimeError("TensorRT EP could not be created")
        self.providers = [p for p in providers if p != CUDA]

    def run(self, outputs: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [feeds["x"] @ (np.arange(32, dtype=np.float32).reshape(8, 4) / 32)]

    def get_providers(self) -> list[str]:
        return self.providers


def test_fallbacks_and_failures_are_reported_as_not_working() -> None:
    results = {
        r.provider: r for r in probe_providers([TENSORRT, CUDA, CPU], session_factory=FakeSession)
    }
    assert list(results) == [TENSORRT, CUDA, CPU]  # the runtime's preference order
    assert not results[TENSORRT].works and "could not be created" in results[TENSORRT].detail
    assert not results[CUDA].works and results[CUDA].detail == f"fell back to {CPU}"
    assert results[CPU].works


def test_doctor_reports_the_provider_serving_each_backbone_of_a_bundle(small_zoo) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    doctor = [str(Path(sys.executable).parent / "edge-agent"), "doctor"]
    result = subprocess.run(
        [*doctor, "--bundle", str(small_zoo)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    served = json.loads(result.stdout)["bundle"]["backbones"]
    assert list(served) == ["letters", "shapes", "fontdigits"]
    assert {b["served_by"] for b in served.values()} == {CPU}  # no GPU provider on this machine
    refused = subprocess.run(
        [*doctor, "--engine-cache", "x"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and "--engine-cache applies with --bundle" in refused.stderr


class ListedButBroken:
    """onnxruntime-gpu on a machine without libnvinfer: TensorRT is listed, a session that
    asks for it prints onnxruntime's fallback block to stdout and runs on the CPU. Every
    other session is a real CPU session; ``requests`` records what each one asked for."""

    def __init__(self) -> None:
        self.requests: list[list[str]] = []

    def __call__(
        self, model: Any, *, sess_options: Any = None, providers: list[str], provider_options: Any
    ) -> Any:
        import onnxruntime as ort

        self.requests.append(list(providers))
        if TENSORRT in providers:
            # onnxruntime's own words (onnxruntime_inference_collection.py), on stdout.
            print("*************** EP Error ***************")
            print(
                f"EP Error libnvinfer.so.10: cannot open shared object file when using {providers}"
            )
            print("Falling back to ['CPUExecutionProvider'] and retrying.")
            print("****************************************")
        return ort.InferenceSession(model, sess_options=sess_options, providers=[CPU])


def test_a_listed_but_broken_provider_is_probed_once_then_never_requested(
    small_zoo, capfd, caplog
) -> None:

    factory = ListedButBroken()
    with caplog.at_level("WARNING"):
        runtime = BackboneRuntime(small_zoo, available=[TENSORRT, CPU], session_factory=factory)
    probe_requests, backbone_requests = factory.requests[:2], factory.requests[2:]
    assert probe_requests == [[TENSORRT, CPU], [CPU]]
    assert backbone_requests == [[CPU]] * len(runtime.bundle.members)  # TensorRT never again
    assert {r.provider: r.works for r in runtime.probes} == {TENSORRT: False, CPU: True}
    out, _ = capfd.readouterr()
    assert out == ""  # onnxruntime's block went to the log instead
    assert any("onnxruntime: EP Error libnvinfer" in r.getMessage() for r in caplog.records)


def test_the_probe_is_kept_per_build_and_machine_and_refreshed_on_demand(
    tmp_path, monkeypatch
) -> None:
    import json

    monkeypatch.setattr(probe, "_PROBED", {})
    cache = tmp_path / "providers" / probe.CACHE_FILE
    (first,) = probe.working_providers([CPU], cache=cache)
    kept = json.loads(cache.read_text())
    assert first.works and kept["key"]["onnxruntime"] and kept["key"]["available"] == CPU
    # A later process (empty memo) reads the file instead of probing: mark it to tell.
    kept["probes"][0]["detail"] = "read from the cache"
    cache.write_text(json.dumps(kept))
    monkeypatch.setattr(probe, "_PROBED", {})
    assert probe.working_providers([CPU], cache=cache)[0].detail == "read from the cache"
    # A file written by another onnxruntime build is probed anew.
    kept["key"]["onnxruntime"] = "0.0.0"
    cache.write_text(json.dumps(kept))
    monkeypatch.setattr(probe, "_PROBED", {})
    assert probe.working_providers([CPU], cache=cache)[0].detail == "ran one inference"
    kept = json.loads(cache.read_text())
    kept["probes"][0]["detail"] = "stale"
    cache.write_text(json.dumps(kept))
    assert probe.working_providers([CPU], cache=cache, refresh=True)[0].detail == (
        "ran one inference"
    )
    cache.write_text("{not json")
    monkeypatch.setattr(probe, "_PROBED", {})
    assert probe.working_providers([CPU], cache=cache)[0].works
    # A probe this process made without a cache is kept once a cache is named.
    other = tmp_path / "other" / probe.CACHE_FILE
    assert probe.working_providers([CPU], cache=other)[0].works and other.exists()
