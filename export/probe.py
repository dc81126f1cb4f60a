"""Does an execution provider really run here? A tiny model answers it on the device.

``onnxruntime.get_available_providers()`` lists what a build *contains*, not what works:
a Jetson whose CUDA libraries do not match, or a container without the GPU device nodes,
lists CUDA and TensorRT and silently runs on the CPU. The installers and
``edge-agent doctor`` run one real inference per provider and read back which provider
the session kept.

The answer is kept per onnxruntime build and machine (:func:`working_providers`): the
backbone runtime asks it before every session it opens and requests only the providers
that worked, so a listed-but-broken provider (TensorRT without ``libnvinfer``) is tried
once, by the probe, and never again until the build, the machine or its GPU driver change
or ``edge-agent doctor --refresh`` asks anew.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from export import ortlog
from export.providers import CPU, choose_providers
from runtime.files import atomic_write

log = logging.getLogger(__name__)
#: The probe's file in a cache folder (the agent's: ``<state_dir>/providers``).
CACHE_FILE = "probe.json"
CACHE_FORMAT = 1

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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbeResult:
        return cls(str(data["provider"]), bool(data["works"]), str(data["detail"]))


def probe_providers(
    available: Sequence[str],
    *,
    session_factory: Callable[..., Any] | None = None,
) -> list[ProbeResult]:
    """One inference per provider this build offers (fastest first), each in its own
    session with CPU as the fallback; a provider works when the session kept it and the
    answer is right."""
    options: Any = None
    if session_factory is None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        session_factory = ort.InferenceSession

    results = []
    for name, opts in choose_providers(available):
        chain = [(name, opts)] if name == CPU else [(name, opts), (CPU, {})]
        try:
            # A provider that fails makes onnxruntime print its fallback to stdout.
            with ortlog.captured(log):
                session = session_factory(
                    PROBE_MODEL,
                    sess_options=options,
                    providers=[p for p, _ in chain],
                    provider_options=[o for _, o in chain],
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


def machine_key(available: Sequence[str]) -> dict[str, str]:
    """What the probe's answer depends on: the onnxruntime build (version, build info,
    where it is installed, the providers it lists), the machine, and its NVIDIA driver
    (an upgrade can make CUDA work, or stop it)."""
    import onnxruntime as ort

    def read(path: str) -> str:
        try:
            return Path(path).read_text(errors="replace").strip()
        except OSError:
            return ""

    driver = read("/proc/driver/nvidia/version")
    return {
        "onnxruntime": ort.__version__,
        "build": getattr(ort, "get_build_info", lambda: "")(),
        "package": str(Path(ort.__file__).resolve().parent),
        "python": sys.version.split()[0],
        "available": ",".join(available),
        "machine": platform.machine(),
        "host": platform.node(),
        "machine_id": read("/etc/machine-id"),
        "nvidia_driver": hashlib.sha256(driver.encode()).hexdigest()[:16] if driver else "",
    }


#: Probes run in this process, by machine key: a simulated fleet opens one runtime per
#: client, and each would otherwise probe again.
_PROBED: dict[str, list[ProbeResult]] = {}


def working_providers(
    available: Sequence[str],
    *,
    cache: Path | None = None,
    refresh: bool = False,
    session_factory: Callable[..., Any] | None = None,
) -> list[ProbeResult]:
    """The probe's answer for ``available`` on this machine: read from ``cache`` (a JSON
    file) when it was written for the same onnxruntime build and machine, else probed and
    written there. ``refresh`` probes anew whatever is kept. A ``session_factory`` (tests)
    always probes and is never cached."""
    if session_factory is not None:
        return probe_providers(available, session_factory=session_factory)
    key = machine_key(available)
    memo = json.dumps(key, sort_keys=True)
    if refresh or memo not in _PROBED:
        kept = None if cache is None or refresh else _read_cache(cache, key)
        if kept is not None:
            _PROBED[memo] = kept
            return kept
        _PROBED[memo] = probe_providers(available)
    results = _PROBED[memo]
    # Kept even when this process probed before without a cache (an export, say): the
    # agent's next start then finds it.
    if cache is not None and (refresh or _read_cache(cache, key) != results):
        data = {"format": CACHE_FORMAT, "key": key, "probes": [r.to_json() for r in results]}
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(cache, (json.dumps(data, indent=2) + "\n").encode())
        except OSError as exc:  # a read-only state folder costs a probe per start, no more
            log.warning("cannot keep the provider probe in %s: %s", cache, exc)
    return results


def _read_cache(path: Path, key: dict[str, str]) -> list[ProbeResult] | None:
    try:
        data = json.loads(path.read_text())
        if data.get("format") != CACHE_FORMAT or data.get("key") != key:
            return None  # another build or machine: probe anew
        return [ProbeResult.from_json(r) for r in data["probes"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the damaged provider probe %s (%s); probing again", path, exc)
        return None
