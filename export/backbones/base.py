"""What every built-in backbone shares: the base class and the conv-BN-activation unit.

Every model maps an image batch ``(B, 3, H, W)`` to its penultimate feature vector
``(B, feature_dim)``.
"""

from __future__ import annotations

from torch import nn


class Backbone(nn.Module):
    """Base for the built-in backbones: ``feature_dim`` and a default input shape."""

    feature_dim: int
    input_shape: tuple[int, int, int]


def conv_bn_act(
    cin: int, cout: int, k: int, stride: int, groups: int, act: type[nn.Module] | None
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)
