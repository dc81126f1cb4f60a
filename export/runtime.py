"""The ONNX Runtime wrapper the agent uses: one session per backbone, the fastest
provider this machine has, and batched extraction of the concatenated features."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from export import bundle as bundle_mod
from export.bundle import INPUT_NAME, Bundle, Member
from export.errors import BundleError

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
    Jetson builds its engines once), then CUDA, then CPU, keeping those this build of
    onnxruntime has. ``requested`` overrides the order; unknown or unavailable names are
    dropped with a warning, and CPU is always last so a session can always be created.
    """
    order = list(requested) if requested else list(PREFERENCE)
    for name in order:
        if requested and name not in available:
            log.warning(
                "execution provider %s is not available here (have: %s)",
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


@dataclass(frozen=True)
class RuntimeSettings:
    providers: tuple[str, ...] = ()  # empty: TensorRT, CUDA, CPU as available
    intra_op_threads: int = 0  # 0: onnxruntime's default (all cores)
    inter_op_threads: int = 0
    batch_size: int = 64
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if min(self.intra_op_threads, self.inter_op_threads) < 0:
            raise ValueError(
                "runtime.intra_op_threads and inter_op_threads must be >= 0 (0: default)"
            )
        if self.batch_size < 1:
            raise ValueError(f"runtime.batch_size must be at least 1, got {self.batch_size}")


def quiet_threads(options: Any) -> None:
    """Stop idle intra-op threads from spin-waiting. The K sessions of a bundle run one
    after another; with spinning on, each session's pool keeps the cores busy while the
    next session works, and three backbones on two cores ran 2.5x slower together than
    the sum of their parts."""
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")


def preprocess(images: np.ndarray, member: Member) -> np.ndarray:
    """(N, 3, H, W) float in [0, 1], RGB -> the member's normalised input, resized if needed."""
    c, h, w = member.input_shape
    x = images
    if x.shape[1] != c:
        raise BundleError(f"{member.name} expects {c} channels, got images of shape {x.shape}")
    if member.channel_order == "BGR":
        x = x[:, ::-1]
    if x.shape[2:] != (h, w):
        import torch  # only needed when the data's size differs from the backbone's

        x = torch.nn.functional.interpolate(
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
            size=(h, w),
            mode="bilinear",
            antialias=True,
        ).numpy()
    mean = np.asarray(member.mean, dtype=np.float32)[None, :, None, None]
    std = np.asarray(member.std, dtype=np.float32)[None, :, None, None]
    return np.ascontiguousarray((x - mean) / std, dtype=np.float32)


class BackboneRuntime:
    """Loads every backbone of a bundle into an ONNX Runtime session.

    ``samples_processed`` counts the images that went through the backbones, so callers
    (and tests) can prove a feature cache was hit.
    """

    def __init__(self, bundle: Bundle | Path, *, settings: RuntimeSettings | None = None) -> None:
        import onnxruntime as ort

        self.bundle = bundle if isinstance(bundle, Bundle) else bundle_mod.load(bundle)
        if isinstance(bundle, Bundle):
            problems = bundle_mod.hash_problems(self.bundle)
            if problems:
                raise BundleError(problems[0][1], file=problems[0][0])
        self.settings = settings or RuntimeSettings()
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.settings.intra_op_threads
        options.inter_op_num_threads = self.settings.inter_op_threads
        options.log_severity_level = 3
        quiet_threads(options)
        providers = choose_providers(
            ort.get_available_providers(),
            requested=self.settings.providers or None,
            cache_dir=self.settings.cache_dir,
        )
        self.sessions = [
            ort.InferenceSession(
                str(self.bundle.file(m)),
                sess_options=options,
                providers=[p for p, _ in providers],
                provider_options=[o for _, o in providers],
            )
            for m in self.bundle.members
        ]
        self.samples_processed = 0
        self.active_providers: dict[str, list[str]] = {}
        self._warm_up()

    def _warm_up(self) -> None:
        # Providers can fall back silently at the first run (a TensorRT engine that fails
        # to build); the truth is get_providers() after a real inference.
        for member, session in zip(self.bundle.members, self.sessions, strict=True):
            session.run(None, {INPUT_NAME: np.zeros((1, *member.input_shape), dtype=np.float32)})
            self.active_providers[member.name] = list(session.get_providers())
            log.info(
                "backbone %s runs on %s", member.name, ", ".join(self.active_providers[member.name])
            )

    @property
    def feature_dim(self) -> int:
        return self.bundle.feature_dim

    def extract(self, images: np.ndarray, *, progress: Any = None) -> np.ndarray:
        """Features ``r_x`` of (N, 3, H, W) float images in [0, 1]: (N, sum of output dims)."""
        if images.ndim != 4:
            raise ValueError(f"images must be (N, 3, H, W), got shape {images.shape}")
        out = np.empty((len(images), self.feature_dim), dtype=np.float32)
        step = self.settings.batch_size
        for start in range(0, len(images), step):
            batch = images[start : start + step]
            col = 0
            for member, session in zip(self.bundle.members, self.sessions, strict=True):
                feats = session.run(None, {INPUT_NAME: preprocess(batch, member)})[0]  # (b, d_k)
                out[start : start + len(batch), col : col + member.output_dim] = feats
                col += member.output_dim
            self.samples_processed += len(batch)
            if progress is not None:
                progress.update(len(batch))
        return out
