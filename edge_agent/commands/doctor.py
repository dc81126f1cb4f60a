"""``edge-agent doctor``: which ONNX Runtime execution providers really run here, and
which serves each backbone of a bundle."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from export.errors import BundleError
from export.probe import probe_providers
from export.runtime import CPU, BackboneRuntime, RuntimeSettings
from runtime.cliutil import UsageError


def cmd_doctor(args: argparse.Namespace) -> int:
    # Lazy: ONNX Runtime takes a while to load, and `edge-agent --help` never needs it.
    import onnxruntime as ort

    probes = probe_providers(ort.get_available_providers())
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
    if args.bundle is not None:
        report["bundle"] = _serving(args.bundle, args.engine_cache)
    json.dump(report, sys.stdout, indent=2)
    print()
    if args.require_gpu and not accelerated:
        print(
            "edge-agent: no GPU execution provider works here; the agent will run on the CPU",
            file=sys.stderr,
        )
        return 1
    return 0


def _serving(path: Path, engine_cache: Path | None) -> dict[str, object]:
    """Which provider serves each backbone of the bundle at ``path``, after one real
    inference (a provider can fall back at the first run, e.g. when an engine fails)."""
    try:
        runtime = BackboneRuntime(path, settings=RuntimeSettings(cache_dir=engine_cache))
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    return {
        "path": str(path),
        "bundle_id": runtime.bundle.id,
        "backbones": {
            m.name: {
                "precision": m.precision,
                "input_shape": list(m.input_shape),
                "served_by": runtime.active_providers[m.name][0],
                "providers": runtime.active_providers[m.name],
            }
            for m in runtime.bundle.members
        },
    }
