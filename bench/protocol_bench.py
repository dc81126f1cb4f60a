"""Protocol benchmarks: message sizes and raw-bytes arrays vs msgpack float lists."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from export.timing import seconds_per_call
from protocol.messages import PrototypeUpdate


def sample_update(
    dtype: type[np.floating[Any]], *, classes: int = 10, dim: int = 256
) -> PrototypeUpdate:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(classes, dim))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return PrototypeUpdate(
        fleet="bench-fleet",
        round=12,
        client="device-0042",
        bundle="a" * 64,
        method="fedpcl",
        classes=tuple(range(classes)),
        counts=tuple(int(c) for c in rng.integers(1, 500, size=classes)),
        prototypes=z.astype(dtype),
    )


def _floatlist_payload(update: PrototypeUpdate) -> bytes:
    """The same message with the array as a msgpack list of floats: the naive encoding."""
    return msgpack.packb(
        {
            "v": 1,
            "type": "update",
            "fleet": update.fleet,
            "round": update.round,
            "client": update.client,
            "bundle": update.bundle,
            "method": update.method,
            "classes": list(update.classes),
            "counts": list(update.counts),
            "prototypes": update.prototypes.tolist(),
            "extras": {},
            "privacy": update.privacy.to_obj(),
        },
        use_bin_type=True,
    )


def run() -> dict[str, float]:
    f16 = sample_update(np.float16)
    f32 = sample_update(np.float32)
    payload = f16.to_wire()
    raw_s = seconds_per_call(f16.to_wire)
    list_s = seconds_per_call(lambda: _floatlist_payload(f16))
    decode_s = seconds_per_call(lambda: PrototypeUpdate.from_wire(payload))
    return {
        "protocol.update_f16_bytes": len(payload),
        "protocol.update_f32_bytes": len(f32.to_wire()),
        "protocol.floatlist_f16_bytes": len(_floatlist_payload(f16)),
        "protocol.encode_us": raw_s * 1e6,
        "protocol.encode_floatlist_us": list_s * 1e6,
        "protocol.encode_speedup_vs_floatlist": list_s / raw_s,
        "protocol.decode_us": decode_s * 1e6,
    }
