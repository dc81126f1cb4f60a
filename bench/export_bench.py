"""Export benchmarks: torch eager vs ONNX Runtime fp32 vs int8, for ResNet-18 at
3x224x224 and for the zoo bundle (built with `edge-export zoo` into bench/zoo if missing)."""

from __future__ import annotations

from pathlib import Path

from export import bench
from export import bundle as bundle_mod
from fleet.data import bundles
from fleet.data.bundles import ensure_bundle

ZOO = Path(__file__).resolve().parent / "zoo"


def ensure_zoo() -> Path:
    """The full zoo every benchmark uses, built once (about 5 minutes) if missing."""
    return ensure_bundle(ZOO, "full")


def ensure_basis() -> Path:
    """The zoo's public basis (export/basis.py: rendered images only), written once (about
    20 seconds) if missing: the file closed-form fleets name as ``closed_form.basis``."""
    return bundles.ensure_basis(ensure_zoo())


def run() -> dict[str, float]:
    results = bench.headline(bench.run(bench.targets_for_arch("resnet18", 224)), "export.resnet18_")
    zoo = bundle_mod.load(ensure_zoo())
    results |= bench.headline(bench.run(bench.targets_for_bundle(zoo)), "export.zoo_")
    return results
