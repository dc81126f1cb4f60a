"""The registry of backbone architectures: the one place an architecture is added.

Each family lives in its own module under :mod:`export.backbones`; every model maps an
image batch ``(B, 3, H, W)`` to its penultimate feature vector ``(B, feature_dim)``.
ResNet-18/34 use torchvision's module names, so a torchvision or timm ResNet checkpoint
loads by key (see :func:`load_state_dict_by_key`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from export.backbones.base import Backbone
from export.backbones.cnn import SmallCNN
from export.backbones.efficientnet import EfficientNetLite0
from export.backbones.mobilenet import MobileNetV3Small
from export.backbones.resnet import ResNet
from export.backbones.vit import SmallViT

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Backbone",
    "EfficientNetLite0",
    "MobileNetV3Small",
    "ResNet",
    "SmallCNN",
    "SmallViT",
    "build",
    "load_state_dict_by_key",
]


@dataclass(frozen=True)
class Architecture:
    factory: Callable[..., Backbone]
    description: str


ARCHITECTURES: dict[str, Architecture] = {
    "resnet18": Architecture(
        lambda **kw: ResNet((2, 2, 2, 2), **kw), "ResNet-18, torchvision key layout, 512-d"
    ),
    "resnet34": Architecture(
        lambda **kw: ResNet((3, 4, 6, 3), **kw), "ResNet-34, torchvision key layout, 512-d"
    ),
    "mobilenetv3_small": Architecture(MobileNetV3Small, "MobileNetV3-Small, 576-d"),
    "vit_small": Architecture(SmallViT, "small ViT (patch 4, 4 blocks, 128-d) for 32x32"),
    "cnn32": Architecture(SmallCNN, "4-stage CNN for 32x32, 256-d"),
    "efficientnet_lite0": Architecture(
        EfficientNetLite0, "EfficientNet-Lite0 (ImageNet layout, 224x224), 1280-d L2-normalised"
    ),
}


def build(name: str, **kwargs: Any) -> Backbone:
    """Instantiate a registered architecture; an unknown name raises ValueError."""
    try:
        arch = ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"unknown architecture {name!r}; available: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
    return arch.factory(**kwargs)


#: Classifier parameters a pretrained checkpoint may carry; a backbone has no classifier.
_CLASSIFIER_PREFIXES = ("fc.", "_fc.", "classifier.", "head.", "heads.")


def load_state_dict_by_key(model: nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Load a checkpoint by parameter name, ignoring classifier weights.

    Returns the ignored keys. Raises ValueError naming missing, unexpected or mis-shaped
    keys, so a checkpoint for another architecture is refused rather than half-loaded.
    """
    if "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]  # Lightning-style wrapper
    clean = {k.removeprefix("module."): v for k, v in state.items()}  # DataParallel prefix
    ignored = sorted(k for k in clean if k.startswith(_CLASSIFIER_PREFIXES))
    wanted = model.state_dict()
    clean = {k: v for k, v in clean.items() if k not in ignored}
    missing = sorted(set(wanted) - set(clean))
    unexpected = sorted(set(clean) - set(wanted))
    shapes = sorted(
        k for k in set(wanted) & set(clean) if tuple(wanted[k].shape) != tuple(clean[k].shape)
    )
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append(f"shape mismatch {shapes[:5]}")
        raise ValueError("checkpoint does not fit the architecture: " + "; ".join(parts))
    model.load_state_dict(clean, strict=True)
    return ignored
