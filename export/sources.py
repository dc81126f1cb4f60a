"""Where a backbone comes from: a built-in architecture (optionally with a checkpoint), a
TorchScript file, an import path to a factory, or an existing ONNX file."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from export import architectures
from export.errors import ExportError
from protocol import validate_id

KINDS = ("arch", "torchscript", "factory", "onnx")


#: The keys of a ``--backbone`` spec, as `edge-export bundle --help` lists them.
SPEC_KEYS = ("name", "arch", "weights", "torchscript", "factory", "onnx", "input", "mean", "std")


@dataclass(frozen=True)
class Source:
    """One backbone to put in a bundle.

    Exactly one of ``arch``, ``torchscript``, ``factory`` (``package.module:function``) or
    ``onnx`` names the model; ``weights`` is a state dict for ``arch``. ``input_size`` sets
    the square input side for models that do not declare it.
    """

    name: str
    arch: str | None = None
    weights: Path | None = None
    torchscript: Path | None = None
    factory: str | None = None
    onnx: Path | None = None
    input_size: int | None = None
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    arch_kwargs: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_id(self.name, field="backbone name")
        if self.weights is not None and self.arch is None:
            raise ExportError(
                f"backbone {self.name!r}: weights= needs arch= (a state dict for a built-in architecture)"
            )
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
        """Parse ``name=x,arch=resnet18,weights=w.pt,input=224,mean=0.485/0.456/0.406,...``."""
        fields: dict[str, Any] = {}
        for part in filter(None, text.split(",")):
            key, sep, value = part.partition("=")
            if not sep:
                raise ExportError(
                    f"backbone spec {text!r}: {part!r} is not key=value (for example "
                    "name=mine,onnx=model.onnx; see `edge-export bundle --help`)"
                )
            key = key.strip()
            if key in ("weights", "torchscript", "onnx"):
                fields[key] = Path(value).expanduser()
            elif key in ("name", "arch", "factory"):
                fields[key] = value
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
        return cls(**fields)


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
        from export.onnx_io import onnx_info

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
        if source.weights is not None:
            state = _torch_load(source.weights, source.name)
            try:
                ignored = architectures.load_state_dict_by_key(model, state)
            except ValueError as exc:
                raise ExportError(f"backbone {source.name!r} ({source.weights}): {exc}") from exc
            prov.update(weights=source.weights.name, ignored_keys=ignored)
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


def _torch_load(path: Path, name: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ExportError(f"backbone {name!r}: no such weights file {path}")
    try:
        # weights_only: a checkpoint from elsewhere must not be able to run code.
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise ExportError(f"backbone {name!r}: cannot read {path} as a state dict: {exc}") from exc
    if not isinstance(state, dict):
        raise ExportError(
            f"backbone {name!r}: {path} holds a {type(state).__name__}, not a state dict"
        )
    return state
