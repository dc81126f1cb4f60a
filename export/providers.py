"""ONNX Runtime's execution providers as this project names and orders them, and the
options each is opened with. Both the provider probe (export/probe.py) and the backbone
runtime (export/runtime.py) read these, so the runtime can ask the probe which of them
work without the two modules importing each other."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
PREFERENCE = (TENSORRT, CUDA, CPU)

ProviderSpec = tuple[str, dict[str, Any]]


def choose_providers(
    available: Sequence[str],
    *,
    requested: Sequence[str] | None = None,
    cache_dir: Path | None = None,
) -> list[ProviderSpec]:
    """Providers to try, fastest first, with their options.

    Default order: TensorRT (fp16, engine and timing caches under ``cache_dir`` so a
    Jetson builds its engines once), then CUDA, then CPU, keeping those in ``available``
    (what this build offers, or what the probe found working). ``requested`` overrides
    the order; names not in ``available`` are dropped with a warning, and CPU is always
    last so a session can always be created.
    """
    order = list(requested) if requested else list(PREFERENCE)
    for name in order:
        if requested and name not in available:
            log.warning(
                "execution provider %s is not available or does not work here (have: %s)",
                name,
                ", ".join(available),
            )
    chosen: list[ProviderSpec] = []
    for name in order:
        if name not in available or any(name == c[0] for c in chosen):
            continue
        options: dict[str, Any] = {}
        if name == TENSORRT:
            options = {"trt_fp16_enable": True}
            if cache_dir is not None:
                trt = cache_dir / "tensorrt"
                trt.mkdir(parents=True, exist_ok=True)
                options |= {
                    "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(trt),
                    "trt_timing_cache_enable": True,
                    "trt_timing_cache_path": str(trt),
                }
        chosen.append((name, options))
    if not any(name == CPU for name, _ in chosen):
        chosen.append((CPU, {}))
    return chosen
