"""MobileNetV3-Small, with a stem that can keep 32x32 inputs spatial."""

from __future__ import annotations

import torch
from torch import nn

from export.backbones.base import Backbone, conv_bn_act


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


class InvertedResidual(nn.Module):
    def __init__(
        self, cin: int, k: int, exp: int, cout: int, se: bool, act: type[nn.Module], stride: int
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if exp != cin:
            layers.append(conv_bn_act(cin, exp, 1, 1, 1, act))
        layers.append(conv_bn_act(exp, exp, k, stride, exp, act))
        if se:
            layers.append(SqueezeExcite(exp))
        layers.append(conv_bn_act(exp, cout, 1, 1, 1, None))
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
        layers: list[nn.Module] = [conv_bn_act(3, 16, 3, 1 if small_input else 2, 1, nn.Hardswish)]
        cin = 16
        for k, exp, cout, se, act, stride in _MNV3_SMALL:
            layers.append(InvertedResidual(cin, k, exp, cout, se, act, stride))
            cin = cout
        layers.append(conv_bn_act(cin, 576, 1, 1, 1, nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = 576
        self.input_shape = (3, input_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.avgpool(self.features(x)), 1)  # (B, 576)
