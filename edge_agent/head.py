"""The projection head of FedPCL Table 7: ``FC(K*d_e, 256) -> ReLU -> BN(256)``, output
L2-normalised so every embedding ``z`` has norm 1."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edge_agent.train_config import Norm


class InputMajorLinear(nn.Module):
    """``nn.Linear`` (``y = x W^T + b``, same initialisation, same state dict) whose weight
    is held transposed in memory: a contiguous (in, out) parameter ``weight_t``.

    Why: autograd computes the weight's gradient in the parameter's layout. For nn.Linear's
    (out, in) that is the GEMM ``g^T x``; for (in, out) it is ``x^T g``, and with a batch of
    32 MKL runs the second 2.5x faster (176 vs 441 us for 32 x 1536 -> 256 on the 2-core
    development machine). The head's first layer is the largest cost of a training step on
    cached features. Fused Adam needs contiguous parameters, so a transposed *view* of an
    nn.Linear weight would not do: it copies every tensor in and out at every step.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        reference = nn.Linear(in_features, out_features)  # its initialisation, its RNG draws
        self.weight_t = nn.Parameter(reference.weight.detach().t().contiguous())
        self.bias = nn.Parameter(reference.bias.detach().clone())
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight_t)

    # State dicts keep nn.Linear's keys and (out, in) layout: saved agent states, averaged
    # FedAvg weights and anything else reading ``fc.weight`` see one format.
    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        weight = self.weight_t.t()
        destination[prefix + "weight"] = weight if keep_vars else weight.detach().contiguous()
        destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        weight = state_dict.pop(prefix + "weight", None)
        if weight is not None:
            if tuple(weight.shape) != (self.out_features, self.in_features):
                error_msgs.append(
                    f"size mismatch for {prefix}weight: copying a param with shape "
                    f"{tuple(weight.shape)}, the shape in current model is "
                    f"{(self.out_features, self.in_features)}."
                )
                return
            state_dict[prefix + "weight_t"] = weight.t()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # Report a missing weight under the name the state dict uses.
        missing_keys[:] = [
            prefix + "weight" if k == prefix + "weight_t" else k for k in missing_keys
        ]


class ProjectionHead(nn.Module):
    """``norm="group"`` swaps BatchNorm for a per-sample-safe GroupNorm: BatchNorm mixes
    the samples of a batch, which per-sample gradient clipping (DP-SGD) cannot allow."""

    def __init__(
        self, *, in_dim: int, out_dim: int = 256, norm: Norm = "batch", groups: int = 16
    ) -> None:
        super().__init__()
        if in_dim < 1 or out_dim < 1:
            raise ValueError(f"in_dim and out_dim must be positive, got {in_dim}, {out_dim}")
        self.fc = InputMajorLinear(in_dim, out_dim)
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
