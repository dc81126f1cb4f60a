"""Is a backbone's fp16 still the fp32 backbone, on the provider that runs it?

fp16 is checked where it runs, never only on the CPU: ONNX Runtime's CPU provider runs an
fp16 graph in fp32 between casts, so an fp16 model whose activations leave fp16's range
(overflow, or the underflow of a randomly initialised EfficientNet-Lite0, whose
activations shrink to 1e-8 by its last layer) agrees with fp32 there and breaks on a GPU.
A backbone runs in fp16 when its file is fp16 or when TensorRT is asked for fp16 engines;
its features on the parity inputs the bundle recorded at export (fp32 features of the
source model) must then keep a cosine of at least :data:`MIN_FP16_COSINE`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from export.bundle import INPUT_NAME, Member
from export.providers import TENSORRT

#: The lowest per-image cosine between fp16 and fp32 features a device accepts.
MIN_FP16_COSINE = 0.999


def runs_fp16(member: Member, provider: str, options: dict[str, Any]) -> bool:
    """Whether ``member`` computes in fp16 when ``provider`` with ``options`` serves it."""
    return member.precision == "fp16" or (
        provider == TENSORRT and bool(options.get("trt_fp16_enable"))
    )


def cosines(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per-row cosine of two (N, d) feature matrices; NaN where either row is not finite
    or is zero (an fp16 row flushed to zeros has no direction to compare)."""
    ref = reference.astype(np.float64)
    cand = candidate.astype(np.float64)
    num = np.sum(ref * cand, axis=1)
    den = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = num / den
    return np.where(np.isfinite(cos) & (den > 0), cos, np.nan)


@dataclass(frozen=True)
class Fp16Check:
    """One backbone's fp16 features against fp32 on one provider."""

    backbone: str
    provider: str
    images: int
    min_cosine: float  # NaN: some feature row was not finite or all zeros

    @property
    def ok(self) -> bool:
        return not math.isnan(self.min_cosine) and self.min_cosine >= MIN_FP16_COSINE

    def reason(self) -> str:
        found = (
            "non-finite or all-zero features"
            if math.isnan(self.min_cosine)
            else f"a feature cosine of {self.min_cosine:.4f}"
        )
        return (
            f"backbone {self.backbone}: fp16 on {self.provider} gives {found} against fp32 on "
            f"its {self.images} parity images (at least {MIN_FP16_COSINE} is required)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "images": self.images,
            "min_cosine": None if math.isnan(self.min_cosine) else self.min_cosine,
            "ok": self.ok,
        }


def check_fp16(
    backbone: str,
    session: Any,
    inputs: np.ndarray,
    expected: np.ndarray,
    *,
    provider: str,
    batch: int = 16,
) -> Fp16Check:
    """Run ``inputs`` (preprocessed, (N, C, H, W)) through ``session`` and compare the
    features with ``expected`` (the fp32 features recorded for them)."""
    outs = [
        session.run(None, {INPUT_NAME: np.ascontiguousarray(inputs[i : i + batch])})[0]
        for i in range(0, len(inputs), batch)
    ]
    cos = cosines(expected, np.concatenate(outs))
    low = float(np.nan if np.isnan(cos).any() else cos.min())
    return Fp16Check(backbone, provider, len(inputs), low)
