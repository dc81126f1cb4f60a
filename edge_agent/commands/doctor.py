"""``edge-agent doctor``: which ONNX Runtime execution providers really run here, which
serves each backbone of a bundle, and whether each backbone that runs in fp16 there still
gives fp32's features."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from export.errors import BundleError
from export.probe import CACHE_FILE, working_providers
from export.runtime import CPU, BackboneRuntime, RuntimeSettings
from runtime.cliutil import UsageError


def cmd_doctor(args: argparse.Namespace) -> int:
    # Lazy: ONNX Runtime takes a while to load, and `edge-agent --help` never needs it.
    import onnxruntime as ort

    # Always probed anew; with --refresh the answer replaces the one the agent keeps.
    cache = None if args.refresh is None else args.refresh / CACHE_FILE
    probes = working_providers(ort.get_available_providers(), cache=cache, refresh=True)
    accelerated = [p.provider for p in probes if p.works and p.provider != CPU]
    report = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "onnxruntime": ort.__version__,
        "available": ort.get_available_providers(),
        "probes": [p.to_json() for p in probes],
        "accelerated": accelerated,
    }
    if args.engine_cache is not None and args.bundle is None:
        raise UsageError("--engine-cache applies with --bundle")
    refused: list[str] = []
    if args.bundle is not None:
        report["bundle"], refused = _serving(args.bundle, args.engine_cache)
    json.dump(report, sys.stdout, indent=2)
    print()
    for reason in refused:
        print(f"edge-agent: doctor: {reason}", file=sys.stderr)
    if refused:
        return 1
    if args.require_gpu and not accelerated:
        print(
            "edge-agent: no GPU execution provider works here; the agent will run on the CPU",
            file=sys.stderr,
        )
        return 1
    return 0


def _serving(path: Path, engine_cache: Path | None) -> tuple[dict[str, object], list[str]]:
    """Which provider serves each backbone of the bundle at ``path``, after one real
    inference (a provider can fall back at the first run, e.g. when an engine fails),
    with the fp16 check of each backbone that runs in fp16 there; and why the agent
    would refuse any (an fp16 file whose features there are not fp32's)."""
    try:
        runtime = BackboneRuntime(
            path, settings=RuntimeSettings(cache_dir=engine_cache), refuse_fp16=False
        )
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    backbones: dict[str, object] = {}
    refused = []
    for m in runtime.bundle.members:
        entry: dict[str, object] = {
            "precision": m.precision,
            "input_shape": list(m.input_shape),
            "served_by": runtime.active_providers[m.name][0],
            "providers": runtime.active_providers[m.name],
        }
        if m.name in runtime.fp16_checks:
            entry["fp16"] = runtime.fp16_checks[m.name].to_json()
        if m.name in runtime.fp16_refused:
            entry["refused"] = runtime.fp16_refused[m.name]
            if m.precision == "fp16":  # an fp32 file falls back to fp32 engines instead
                refused.append(runtime.fp16_refused[m.name])
        backbones[m.name] = entry
    return {"path": str(path), "bundle_id": runtime.bundle.id, "backbones": backbones}, refused
