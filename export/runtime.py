"""The ONNX Runtime wrapper the agent uses: one session per backbone, the fastest
provider this machine has (as the provider probe found it working), fp16 checked against
fp32 where it runs, and batched extraction of the concatenated features."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from export import bundle as bundle_mod
from export import ortlog, probe
from export.bundle import INPUT_NAME, Bundle, Member
from export.errors import BundleError
from export.precision import Fp16Check, check_fp16, runs_fp16
from export.providers import CPU, CUDA, PREFERENCE, TENSORRT, ProviderSpec, choose_providers

log = logging.getLogger(__name__)

__all__ = [
    "CPU",
    "CUDA",
    "PREFERENCE",
    "TENSORRT",
    "BackboneRuntime",
    "PrecisionRefused",
    "ProviderSpec",
    "RuntimeSettings",
    "choose_providers",
    "preprocess",
    "quiet_threads",
]


class PrecisionRefused(BundleError):
    """A backbone's fp16 file gives features unlike fp32 on the provider that serves it."""

    def __init__(self, checks: list[Fp16Check]) -> None:
        super().__init__(
            "; ".join(c.reason() for c in checks)
            + ": this device refuses fp16 for it; build the bundle with --precision fp32"
        )
        self.checks = checks


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

    Only the providers the probe found working here are requested (export/probe.py; its
    answer is kept in ``settings.cache_dir`` when there is one), so a provider that is
    listed but broken is never tried again, and whatever onnxruntime prints goes to the
    log, never to stdout. A backbone that runs in fp16 (an fp16 file, or TensorRT's fp16
    engines) is checked against the fp32 features its bundle recorded: TensorRT then
    builds fp32 engines for a backbone that fails, and an fp16 file that fails is refused
    (:class:`PrecisionRefused`) unless ``refuse_fp16=False`` (the doctor, which reports).

    ``available`` and ``session_factory`` stand in for onnxruntime's provider list and
    ``InferenceSession`` (tests: a provider that is listed and then fails).
    ``samples_processed`` counts the images that went through the backbones, so callers
    (and tests) can prove a feature cache was hit.
    """

    def __init__(
        self,
        bundle: Bundle | Path,
        *,
        settings: RuntimeSettings | None = None,
        refuse_fp16: bool = True,
        available: Sequence[str] | None = None,
        session_factory: Callable[..., Any] | None = None,
    ) -> None:
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
        self._options = options
        self._factory = session_factory or ort.InferenceSession
        listed = list(ort.get_available_providers() if available is None else available)
        cache = self.settings.cache_dir
        self.probes = probe.working_providers(
            listed,
            cache=None if cache is None else cache / probe.CACHE_FILE,
            session_factory=session_factory,
        )
        working = [p.provider for p in self.probes if p.works]
        self.providers = choose_providers(
            working, requested=self.settings.providers or None, cache_dir=cache
        )
        self.sessions = [self._open(m, self.providers) for m in self.bundle.members]
        self.samples_processed = 0
        self.active_providers: dict[str, list[str]] = {}
        self.fp16_checks: dict[str, Fp16Check] = {}
        self.fp16_refused: dict[str, str] = {}
        self._warm_up(refuse_fp16)

    def _open(self, member: Member, providers: list[ProviderSpec]) -> Any:
        with ortlog.captured(log):
            return self._factory(
                str(self.bundle.file(member)),
                sess_options=self._options,
                providers=[p for p, _ in providers],
                provider_options=[o for _, o in providers],
            )

    def _run_first(self, member: Member, session: Any) -> list[str]:
        # Providers can fall back at the first run (a TensorRT engine that fails to
        # build); the truth is get_providers() after a real inference.
        with ortlog.captured(log):
            session.run(None, {INPUT_NAME: np.zeros((1, *member.input_shape), dtype=np.float32)})
        return list(session.get_providers())

    def _warm_up(self, refuse_fp16: bool) -> None:
        failed: list[Fp16Check] = []
        for i, member in enumerate(self.bundle.members):
            kept = self._run_first(member, self.sessions[i])
            options = dict(self.providers).get(kept[0], {})
            if member.parity_file is not None and runs_fp16(member, kept[0], options):
                inputs, expected = bundle_mod.load_parity(self.bundle.path / member.parity_file)
                # One image at a time: the warm-up's shape, so TensorRT builds no engine
                # for the check alone (minutes on a Jetson).
                with ortlog.captured(log):
                    check = check_fp16(
                        member.name, self.sessions[i], inputs, expected, provider=kept[0], batch=1
                    )
                self.fp16_checks[member.name] = check
                if not check.ok and member.precision != "fp16":
                    # TensorRT's fp16 engine of an fp32 file: build fp32 engines instead.
                    self.fp16_refused[member.name] = check.reason()
                    log.warning("%s: TensorRT builds fp32 engines for it", check.reason())
                    fp32 = [
                        (p, o | {"trt_fp16_enable": False} if p == TENSORRT else o)
                        for p, o in self.providers
                    ]
                    self.sessions[i] = self._open(member, fp32)
                    kept = self._run_first(member, self.sessions[i])
                elif not check.ok:
                    self.fp16_refused[member.name] = check.reason()
                    failed.append(check)
            self.active_providers[member.name] = kept
            log.info("backbone %s runs on %s", member.name, ", ".join(kept))
        if failed and refuse_fp16:
            raise PrecisionRefused(failed)

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
