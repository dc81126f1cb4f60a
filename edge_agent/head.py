"""The projection head of FedPCL Table 7: ``FC(K*d_e, 256) -> ReLU -> BN(256)``, output
L2-normalised so every embedding ``z`` has norm 1."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

Norm = Literal["batch", "group"]


class ProjectionHead(nn.Module):
    """``norm="group"`` swaps BatchNorm for a per-sample-safe GroupNorm: BatchNorm mixes
    the samples of a batch, which per-sample gradient clipping (DP-SGD) cannot allow."""

    def __init__(
        self, *, in_dim: int, out_dim: int = 256, norm: Norm = "batch", groups: int = 16
    ) -> None:
        super().__init__()
        if in_dim < 1 or out_dim < 1:
            raise ValueError(f"in_dim and out_dim must be positive, got {in_dim}, {out_dim}")
        self.fc = nn.Linear(in_dim, out_dim)
        self.norm: nn.Module
        if norm == "batch":
            self.norm = nn.BatchNorm1d(out_dim)
        elif norm == "group":
            if out_dim % groups:
                raise ValueError(f"out_dim {out_dim} is not divisible by {groups} groups")
            self.norm = nn.GroupNorm(groups, out_dim)
        else:
            raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")
        self.in_dim, self.out_dim = in_dim, out_dim

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        z = self.norm(torch.relu(self.fc(r)))  # (B, out_dim)
        return nn.functional.normalize(z, dim=1)


def local_prototypes(
    z: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedPCL Eq. 5: per-class mean of ``z`` (C, d) and per-class counts (C,); a class
    with no sample has a zero row and count 0."""
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, y, z)
    counts = torch.bincount(y, minlength=num_classes).to(z.dtype)
    return sums / counts.clamp(min=1)[:, None], counts


def predict(
    z: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prototype-based inference: the class whose prototype has the largest dot product with
    ``z``, among ``present`` classes. Returns (class indices, scores)."""
    scores = z @ prototypes.T  # (B, C)
    scores = scores.masked_fill(~present[None, :], float("-inf"))
    best = scores.max(dim=1)
    return best.indices, best.values
