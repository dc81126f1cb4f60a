"""``make gpu-check``: the agent's GPU path measured on the machine it runs on, written as
the ``gpu`` section of bench/results.json (the other sections are kept as they are).

On a machine where ONNX Runtime's CUDA provider works it runs, in this order: the doctor
on the zoo (which provider serves each backbone); ``edge-export bench`` on the zoo and on
EfficientNet-Lite0 at 224 (the published weights when the imagenet extra is installed),
whose GPU arms give the CUDA fp32 and fp16 feature cosines to the CPU provider's fp32;
and a memory-transport fleet with lda and fedpcl. Where no GPU provider works it says so
in one line, writes nothing, and exits 0: the section is only ever measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort
import torch

from bench.export_bench import ensure_zoo
from bench.run import FORMAT, commit, machine
from export import bench
from export import bundle as bundle_mod
from export.errors import ExportError
from export.probe import working_providers
from export.providers import CUDA, TENSORRT
from export.sources import Source, load

HERE = Path(__file__).resolve().parent
SECTION = "gpu"
FLEET_METHODS = "lda,fedpcl"


def gpu_providers() -> tuple[list[str], list[str]]:
    """(what this onnxruntime lists, the GPU providers the probe found working)."""
    import onnxruntime as ort

    listed = ort.get_available_providers()
    working = [p.provider for p in working_providers(listed) if p.works]
    return listed, [p for p in (CUDA, TENSORRT) if p in working]


def flatten(prefix: str, results: dict[str, Any]) -> dict[str, float]:
    """An ``export.bench.run`` report as flat keys: images/s and ratios per device and
    batch, and each arm's feature cosines to the CPU provider's fp32."""
    flat: dict[str, float] = {}
    for batch, devices in results["batches"].items():
        for device, row in devices.items():
            for key, value in row.items():
                suffix = "" if "_vs_" in key else "_ips"
                flat[f"{prefix}{device}_{key}{suffix}_b{batch}"] = float(value)
    for device, arms in results["cosine_vs_cpu_fp32"].items():
        for arm, cos in arms.items():
            for stat in ("mean", "min"):
                if cos[stat] is not None:
                    flat[f"{prefix}{device}_{arm}_cosine_{stat}"] = float(cos[stat])
    for batch, devices in results["batches"].items():
        cpu, cuda = devices.get("cpu", {}), devices.get("cuda", {})
        if "ort_fp32" in cpu and "ort_fp32" in cuda:
            # Across devices on purpose: what the GPU buys the agent over this CPU.
            flat[f"{prefix}ort_fp32_cuda_over_cpu_b{batch}"] = cuda["ort_fp32"] / cpu["ort_fp32"]
    return flat


def _effnet_targets() -> list[Any]:

    try:
        loaded = load(Source.parse("name=effnet-lite0,pretrained=efficientnet-lite0"))
    except ExportError:  # no imagenet extra: random weights, whose fp16 is refused
        return bench.targets_for_arch("efficientnet_lite0", 224)
    assert loaded.module is not None
    return [bench.Target("effnet-lite0", loaded.module.eval(), loaded.input_shape)]


def measure(zoo: Path) -> tuple[dict[str, float], dict[str, Any]]:
    """The section's figures and what it ran on."""

    out: dict[str, float] = {}
    doctor = subprocess.run(
        [str(Path(sys.executable).parent / "edge-agent"), "doctor", "--require-gpu",
         "--bundle", str(zoo)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if doctor.returncode != 0:
        raise RuntimeError(f"edge-agent doctor failed: {doctor.stderr.strip()[-500:]}")
    served = json.loads(doctor.stdout)["bundle"]["backbones"]
    out["gpu.doctor_backbones"] = float(len(served))
    out["gpu.doctor_backbones_on_gpu"] = float(
        sum(b["served_by"] != "CPUExecutionProvider" for b in served.values())
    )
    # int8 is a CPU figure `make bench` measures; its quantization would take minutes here.
    zoo_results = bench.run(bench.targets_for_bundle(bundle_mod.load(zoo)), int8=False)
    out |= flatten("gpu.zoo_", zoo_results)
    effnet = bench.run(_effnet_targets(), int8=False)
    out |= flatten("gpu.effnet_lite0_", effnet)
    with tempfile.TemporaryDirectory(prefix="protofleet-gpu-check-") as tmp:
        start = time.perf_counter()
        fleet = subprocess.run(
            [str(Path(sys.executable).parent / "edge-fleet"), "compare", "--methods",
             FLEET_METHODS, "--seeds", "0", "--transport", "memory", "--bundle", str(zoo),
             "--out", tmp, "--no-progress"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if fleet.returncode != 0:
            raise RuntimeError(f"edge-fleet compare failed: {fleet.stderr.strip()[-500:]}")
        out["gpu.fleet_seconds"] = time.perf_counter() - start
        report = json.loads((Path(tmp) / "report.json").read_text())
        for method in FLEET_METHODS.split(","):
            out[f"gpu.fleet_{method}_final_mean"] = float(report["methods"][method]["final_mean"])
    about: dict[str, Any] = {
        "gpu": effnet["devices"].get("cuda"),
        "onnxruntime": ort.__version__,
        "providers": zoo_results["working"],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "skipped": {"zoo": zoo_results["skipped"], "effnet_lite0": effnet["skipped"]},
        "doctor": {name: b["served_by"] for name, b in served.items()},
    }
    return out, about


def write_section(
    path: Path, results: dict[str, float], about: dict[str, Any], seconds: float
) -> None:
    """Add (or replace) the ``gpu`` section of the results file at ``path``."""
    document: dict[str, Any] = (
        json.loads(path.read_text()) if path.exists() else {"format": FORMAT, "sections": {}}
    )
    document["sections"][SECTION] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": {**machine(), **about},
        "seconds": round(seconds, 1),
        "results": dict(sorted(results.items())),
    }
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure the agent's GPU path (make gpu-check).")
    parser.add_argument("--out", type=Path, default=HERE / "results.json", help="results file")
    parser.add_argument(
        "--zoo", type=Path, help="zoo bundle (default: bench/zoo, built if missing)"
    )
    args = parser.parse_args(argv)
    listed, gpu = gpu_providers()
    if not gpu:
        print(
            f"gpu-check: no GPU here: neither CUDA nor TensorRT works among the providers "
            f"onnxruntime lists ({', '.join(listed)}); nothing measured, {args.out} unchanged"
        )
        return 0

    start = time.perf_counter()
    try:
        results, about = measure(args.zoo or ensure_zoo())
    except RuntimeError as exc:  # a step that failed: say which, write nothing
        print(f"gpu-check: {exc}; nothing written", file=sys.stderr)
        return 1
    write_section(args.out, results, about, time.perf_counter() - start)
    print(
        f"gpu-check: {len(results)} figures on {about['gpu']} written to {args.out} ({platform.node()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
