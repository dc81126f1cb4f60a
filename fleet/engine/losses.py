"""The local objectives of ``edge_agent.train`` over a group of clients at once.

Each function takes a group's embeddings ``z`` (G, B, d), labels ``y`` (G, B) and returns
the *sum over the group* of every client's own loss: the clients' parameters are
disjoint, so one backward pass of the sum yields each client's own gradient. The
per-client terms are the agent's (``edge_agent.losses``) term for term; tests compare the
two on the same batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from edge_agent import losses
from edge_agent.head import local_prototypes
from edge_agent.train import Guidance
from edge_agent.train_config import TrainConfig

#: (z, logits or None, y, guidance, cfg) -> the group's summed loss.
GroupLoss = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, Guidance, TrainConfig], torch.Tensor
]


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(G,) each client's mean cross-entropy over its batch."""
    g, b, c = logits.shape
    return (
        nn.functional.cross_entropy(logits.reshape(g * b, c), y.reshape(-1), reduction="none")
        .view(g, b)
        .mean(dim=1)
    )


def _masked_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(G,) per client the mean of ``values`` (G, B) where ``mask``; 0 where none."""
    maskf = mask.to(values.dtype)
    return (values * maskf).sum(dim=1) / maskf.sum(dim=1).clamp(min=1)


def cross_entropy(z: torch.Tensor, logits: torch.Tensor | None, y: torch.Tensor,
                  g: Guidance, cfg: TrainConfig) -> torch.Tensor:  # fmt: skip
    assert logits is not None
    return _cross_entropy(logits, y).sum()


def fedproto(z: torch.Tensor, logits: torch.Tensor | None, y: torch.Tensor,
             g: Guidance, cfg: TrainConfig) -> torch.Tensor:  # fmt: skip
    """CE + lam * ||z - C_y||^2 over the samples whose class has a global prototype."""
    assert logits is not None
    distance = ((z - g.global_protos[y]) ** 2).sum(dim=-1)  # (G, B)
    return (
        _cross_entropy(logits, y) + cfg.lam * _masked_means(distance, g.global_present[y])
    ).sum()


def fedpcl(z: torch.Tensor, logits: torch.Tensor | None, y: torch.Tensor,
           g: Guidance, cfg: TrainConfig) -> torch.Tensor:  # fmt: skip
    """FedPCL Eq. 8-10 against the announced sets, or in round 0 against each client's own
    batch class means (detached), as ``edge_agent.train.fedpcl_objective``."""
    if not g.has_globals:
        return _own_batch_contrast(z, y, len(g.global_present), cfg)
    targets = g.fedpcl_targets(tau=cfg.tau, include_positive=cfg.include_positive)
    groups, batch, dim = z.shape
    terms, valid = losses._sample_terms(z.reshape(groups * batch, dim), y.reshape(-1), targets)
    terms = terms.view(groups, batch, targets.sets)
    valid = valid.view(groups, batch, targets.sets)
    # losses.weighted_contrast, per client: each set's mean over the client's own samples.
    coefficient = valid * (targets.weights / valid.sum(dim=1).clamp(min=1)).unsqueeze(1)
    return (terms * coefficient).sum()


def _own_batch_contrast(
    z: torch.Tensor, y: torch.Tensor, num_classes: int, cfg: TrainConfig
) -> torch.Tensor:
    """losses.prototype_contrast of each client's batch against its own class means."""
    groups, _batch, dim = z.shape
    # head.local_prototypes over the group: each client's classes as its own C rows.
    slot = (torch.arange(groups).unsqueeze(1) * num_classes + y).reshape(-1)
    flat, counts = local_prototypes(z.detach().reshape(-1, dim), slot, groups * num_classes)
    protos = flat.view(groups, num_classes, dim)
    present = counts.view(groups, num_classes) > 0
    # As ContrastTargets.matrix: the prototypes as contiguous columns, over tau (a
    # transposed operand would take another GEMM path, and other rounding).
    logits = torch.bmm(z, (protos.transpose(1, 2) / cfg.tau).contiguous())  # (G, B, C)
    bias = torch.zeros_like(logits).masked_fill(~present.unsqueeze(1), losses._BIG)
    own = y.unsqueeze(2)
    if not cfg.include_positive:
        bias = bias.scatter(2, own, losses._BIG)  # A(y): the classes other than y
    positive = logits.gather(2, own).squeeze(2)
    terms = torch.logsumexp(logits + bias, dim=2) - positive  # (G, B)
    negatives = present.sum(dim=1, keepdim=True) - (
        0 if cfg.include_positive else present.gather(1, y).long()
    )
    valid = present.gather(1, y) & (negatives > 0)
    return _masked_means(terms, valid).sum()


#: The methods the vector engine trains, with their group objective.
GROUP_LOSSES: dict[str, GroupLoss] = {
    "fedpcl": fedpcl,
    "fedproto": fedproto,
    "solo": cross_entropy,
    "fedavg": cross_entropy,
}
