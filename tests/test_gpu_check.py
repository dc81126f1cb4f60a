"""``make gpu-check``: one line and exit 0 where no GPU works, nothing written; the
figures it would write are flat, per device, with the cross-device ratio named so."""

from __future__ import annotations

from pathlib import Path

from bench import gpu_check


def test_without_a_gpu_it_says_so_in_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith("gpu-check: no GPU here")
    assert not out.exists()


def test_a_gpu_bench_report_flattens_per_device() -> None:
    report = {
        "batches": {
            "32": {
                "cpu": {"torch": 100.0, "ort_fp32": 200.0, "ort_fp32_vs_torch": 2.0},
                "cuda": {
                    "torch": 7000.0,
                    "ort_fp32": 6000.0,
                    "ort_fp16": 6600.0,
                    "fp16_vs_fp32": 1.1,
                },
            }
        },
        "cosine_vs_cpu_fp32": {"cuda": {"ort_fp16": {"mean": 0.9999, "min": 0.9995}}},
    }
    flat = gpu_check.flatten("gpu.zoo_", report)
    assert flat["gpu.zoo_cuda_ort_fp16_ips_b32"] == 6600.0
    assert flat["gpu.zoo_cuda_fp16_vs_fp32_b32"] == 1.1
    assert flat["gpu.zoo_cpu_ort_fp32_vs_torch_b32"] == 2.0
    assert flat["gpu.zoo_cuda_ort_fp16_cosine_min"] == 0.9995
    assert flat["gpu.zoo_ort_fp32_cuda_over_cpu_b32"] == 30.0
