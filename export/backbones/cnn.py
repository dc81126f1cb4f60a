"""A small four-stage CNN for 32x32 inputs."""

from __future__ import annotations

import torch
from torch import nn

from export.backbones.base import Backbone, conv_bn_act


class SmallCNN(Backbone):
    def __init__(self, *, input_size: int = 32, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for i in range(4):
            cout = width * 2**i
            layers += [
                conv_bn_act(cin, cout, 3, 1, 1, nn.ReLU),
                conv_bn_act(cout, cout, 3, 1, 1, nn.ReLU),
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
