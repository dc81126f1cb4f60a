"""Backbone architectures defined in the project (no torchvision), behind a registry.

Every model maps an image batch ``(B, 3, H, W)`` to its penultimate feature vector
``(B, feature_dim)``. ResNet-18/34 use torchvision's module names, so a torchvision or
timm ResNet checkpoint loads by key (see :func:`load_state_dict_by_key`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class Backbone(nn.Module):
    """Base for the built-in backbones: ``feature_dim`` and a default input shape."""

    feature_dim: int
    input_shape: tuple[int, int, int]


# -- ResNet (torchvision layout) -------------------------------------------------------


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(Backbone):
    def __init__(self, layers: tuple[int, int, int, int], *, input_size: int = 224) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.inplanes = 64
        self.layer1 = self._stage(64, layers[0], 1)
        self.layer2 = self._stage(128, layers[1], 2)
        self.layer3 = self._stage(256, layers[2], 2)
        self.layer4 = self._stage(512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = 512
        self.input_shape = (3, input_size, input_size)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _stage(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        stage = [BasicBlock(self.inplanes, planes, stride)]
        stage += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
        self.inplanes = planes
        return nn.Sequential(*stage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x)
        return torch.flatten(self.avgpool(x), 1)  # (B, 512)


# -- MobileNetV3-Small ----------------------------------------------------------------


def _divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        squeeze = _divisible(channels // 4)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.mean(x, dim=(2, 3), keepdim=True)
        s = nn.functional.hardsigmoid(self.fc2(nn.functional.relu(self.fc1(s))))
        return x * s


def _conv_bn_act(
    cin: int, cout: int, k: int, stride: int, groups: int, act: type[nn.Module] | None
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    def __init__(
        self, cin: int, k: int, exp: int, cout: int, se: bool, act: type[nn.Module], stride: int
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if exp != cin:
            layers.append(_conv_bn_act(cin, exp, 1, 1, 1, act))
        layers.append(_conv_bn_act(exp, exp, k, stride, exp, act))
        if se:
            layers.append(SqueezeExcite(exp))
        layers.append(_conv_bn_act(exp, cout, 1, 1, 1, None))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.residual else out


# (kernel, expansion, out, squeeze-excite, activation, stride) from the MobileNetV3 paper.
_MNV3_SMALL = [
    (3, 16, 16, True, nn.ReLU, 2),
    (3, 72, 24, False, nn.ReLU, 2),
    (3, 88, 24, False, nn.ReLU, 1),
    (5, 96, 40, True, nn.Hardswish, 2),
    (5, 240, 40, True, nn.Hardswish, 1),
    (5, 240, 40, True, nn.Hardswish, 1),
    (5, 120, 48, True, nn.Hardswish, 1),
    (5, 144, 48, True, nn.Hardswish, 1),
    (5, 288, 96, True, nn.Hardswish, 2),
    (5, 576, 96, True, nn.Hardswish, 1),
    (5, 576, 96, True, nn.Hardswish, 1),
]


class MobileNetV3Small(Backbone):
    """``small_input=True`` drops the stem's stride so a 32x32 image ends at 2x2 rather
    than 1x1 (the ImageNet layout would leave nothing spatial to pool)."""

    def __init__(self, *, input_size: int = 224, small_input: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn_act(3, 16, 3, 1 if small_input else 2, 1, nn.Hardswish)]
        cin = 16
        for k, exp, cout, se, act, stride in _MNV3_SMALL:
            layers.append(InvertedResidual(cin, k, exp, cout, se, act, stride))
            cin = cout
        layers.append(_conv_bn_act(cin, 576, 1, 1, 1, nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = 576
        self.input_shape = (3, input_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.avgpool(self.features(x)), 1)  # (B, 576)


# -- a small ViT ------------------------------------------------------------------------


class Attention(nn.Module):
    # Written with plain matmuls (no fused attention kernel) so the ONNX export and the
    # int8 quantizer see ordinary MatMul/Softmax nodes.
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, h, N, d/h)
        attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SmallViT(Backbone):
    def __init__(
        self,
        *,
        input_size: int = 32,
        patch: int = 4,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 2,
    ) -> None:
        super().__init__()
        if input_size % patch:
            raise ValueError(f"input_size {input_size} is not a multiple of patch {patch}")
        tokens = (input_size // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[EncoderBlock(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.feature_dim = dim
        self.input_shape = (3, input_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.norm(self.blocks(x))[:, 0]  # (B, dim)


# -- a small CNN for 32x32 --------------------------------------------------------------


class SmallCNN(Backbone):
    def __init__(self, *, input_size: int = 32, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for i in range(4):
            cout = width * 2**i
            layers += [
                _conv_bn_act(cin, cout, 3, 1, 1, nn.ReLU),
                _conv_bn_act(cout, cout, 3, 1, 1, nn.ReLU),
            ]
            if i < 3:
                layers.append(nn.MaxPool2d(2))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = cin
        self.input_shape = (3, input_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.avgpool(self.features(x)), 1)  # (B, 8 * width)


# -- registry -----------------------------------------------------------------------------


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
_CLASSIFIER_PREFIXES = ("fc.", "classifier.", "head.", "heads.")


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
