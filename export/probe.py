"""Does an execution provider really run here? A tiny model answers it on the device.

``onnxruntime.get_available_providers()`` lists what a build *contains*, not what works:
a Jetson whose CUDA libraries do not match, or a container without the GPU device nodes,
lists CUDA and TensorRT and silently runs on the CPU. The installers and
``edge-agent doctor`` run one real inference per provider and read back which provider
the session kept.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from export.runtime import CPU, choose_providers

# y = x @ w, x: (1, 8) float32, w = arange(32).reshape(8, 4) / 32; opset 17, IR 8.
# Kept as bytes so the agent needs no `onnx` package; tests/test_probe.py rebuilds it with
# onnx.helper and checks the bytes are the same.
PROBE_MODEL = base64.b64decode(
    "CAgSCnByb3RvZmxlZXQ60wEKEQoBeAoBdxIBeSIGTWF0TXVsEgVwcm9iZSqMAQgICAQQAUIBd0qAAQAAAAAAAAA9"
    "AACAPQAAwD0AAAA+AAAgPgAAQD4AAGA+AACAPgAAkD4AAKA+AACwPgAAwD4AANA+AADgPgAA8D4AAAA/AAAIPwAA"
    "ED8AABg/AAAgPwAAKD8AADA/AAA4PwAAQD8AAEg/AABQPwAAWD8AAGA/AABoPwAAcD8AAHg/WhMKAXgSDgoMCAES"
    "CAoCCAEKAggIYhMKAXkSDgoMCAESCAoCCAEKAggEQgQKABAR"
)
PROBE_INPUT = np.linspace(-1.0, 1.0, 8, dtype=np.float32)[None]
PROBE_OUTPUT = PROBE_INPUT @ (np.arange(32, dtype=np.float32).reshape(8, 4) / 32)


@dataclass(frozen=True)
class ProbeResult:
    provider: str
    works: bool
    detail: str

    def to_json(self) -> dict[str, object]:
        return {"provider": self.provider, "works": self.works, "detail": self.detail}


def probe_providers(
    available: Sequence[str],
    *,
    session_factory: Callable[..., Any] | None = None,
) -> list[ProbeResult]:
    """One inference per provider this build offers (fastest first), each in its own
    session with CPU as the fallback; a provider works when the session kept it and the
    answer is right."""
    if session_factory is None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3

        def session_factory(**kwargs: Any) -> Any:
            return ort.InferenceSession(PROBE_MODEL, sess_options=options, **kwargs)

    results = []
    for name, opts in choose_providers(available):
        chain = [(name, opts)] if name == CPU else [(name, opts), (CPU, {})]
        try:
            session = session_factory(
                providers=[p for p, _ in chain], provider_options=[o for _, o in chain]
            )
            (out,) = session.run(None, {"x": PROBE_INPUT})
            kept = list(session.get_providers())
        except Exception as exc:  # any failure to build or run means "does not work"
            results.append(ProbeResult(name, False, f"{type(exc).__name__}: {exc}"))
            continue
        if name not in kept:
            results.append(ProbeResult(name, False, f"fell back to {', '.join(kept)}"))
        elif not np.allclose(out, PROBE_OUTPUT, atol=1e-2):
            results.append(ProbeResult(name, False, "wrong result"))
        else:
            results.append(ProbeResult(name, True, "ran one inference"))
    return results
