"""The local objectives as pure functions of embeddings, labels and prototypes.

Shapes: ``z`` (B, d) unit-norm embeddings, ``y`` (B,) class indices, prototype sets
(C, d) with a (C,) boolean ``present`` mask for classes that have a prototype.
A sample whose own class has no prototype contributes nothing to a prototype term.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if not bool(mask.any()):
        return values.sum() * 0.0  # keeps the graph (and the device) for an empty term
    return values[mask].mean()


def prototype_contrast(
    z: torch.Tensor,
    y: torch.Tensor,
    protos: torch.Tensor,
    present: torch.Tensor,
    *,
    tau: float,
    include_positive: bool = False,
) -> torch.Tensor:
    """One prototype-wise contrastive term (FedPCL Eq. 8 for one prototype set):

    ``-log( exp(z . C_y / tau) / sum_{a in A(y)} exp(z . C_a / tau) )``

    with ``A(y)`` the present classes other than ``y`` as printed in the paper, or all
    present classes (the standard softmax) with ``include_positive``. Averaged over the
    samples whose class is present and that have at least one negative.
    """
    return prototype_contrast_sets(
        z, y, protos[None], present[None], tau=tau, include_positive=include_positive
    )[0]


@dataclass(frozen=True)
class ContrastTargets:
    """S prototype sets prepared once for :func:`contrast_terms`: everything that does
    not depend on the batch. A training step of the small head is dominated by per-op
    overhead, so a round's sets are stacked, transposed, scaled and masked once, not once
    per step, and a sample's masks are looked up by its class."""

    matrix: torch.Tensor  # (d, S*C): the sets' prototypes as columns, over tau
    # (C, S, C): for a sample of class c, 0 for the classes of its denominator in each set,
    # a large negative for the others (absent from the set; c itself unless included).
    bias: torch.Tensor
    valid: torch.Tensor  # (C, S) float: 1 where a sample of class c counts in set s
    weights: torch.Tensor  # (S,): each set's weight in :func:`weighted_contrast`
    sets: int
    classes: int

    @classmethod
    def build(
        cls,
        sets: torch.Tensor,
        present: torch.Tensor,
        *,
        tau: float,
        include_positive: bool,
        weights: torch.Tensor | None = None,
    ) -> ContrastTargets:
        """``sets`` (S, C, d) with masks (S, C); ``weights`` (S,) default to ones."""
        s, c, d = sets.shape
        # A large finite negative instead of -inf: a row with no negatives then has a
        # finite (weighted-out) value and a finite gradient, where -inf gives NaN.
        bias = torch.zeros(c, s, c, dtype=sets.dtype).masked_fill(~present[None], _BIG)
        if not include_positive:
            own = torch.arange(c)
            bias[own, :, own] = _BIG  # A(y): the classes other than y
        negatives = present.sum(dim=1)[None, :] - (0 if include_positive else present.T.long())
        return cls(
            matrix=(sets.reshape(s * c, d).T / tau).contiguous(),
            bias=bias,
            valid=(present.T & (negatives > 0)).to(sets.dtype),
            weights=torch.ones(s, dtype=sets.dtype) if weights is None else weights,
            sets=s,
            classes=c,
        )


_BIG = torch.finfo(torch.float32).min / 4


def _sample_terms(
    z: torch.Tensor, y: torch.Tensor, targets: ContrastTargets
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's term against each set, (B, S), and where it counts, (B, S) float.
    One matrix product and a few ops on (B, S, C)."""
    batch = len(y)
    logits = (z @ targets.matrix).view(batch, targets.sets, targets.classes)
    own = y.view(batch, 1, 1).expand(batch, targets.sets, 1)
    positive = logits.gather(2, own).squeeze(2)  # (B, S)
    terms = torch.logsumexp(logits + targets.bias[y], dim=2) - positive
    return terms, targets.valid[y]


def contrast_terms(z: torch.Tensor, y: torch.Tensor, targets: ContrastTargets) -> torch.Tensor:
    """:func:`prototype_contrast` against each of the S prepared sets at once: (S,)
    losses, each the mean over the samples that count in its set."""
    terms, valid = _sample_terms(z, y, targets)
    return (terms * valid).sum(dim=0) / valid.sum(dim=0).clamp(min=1)


def weighted_contrast(z: torch.Tensor, y: torch.Tensor, targets: ContrastTargets) -> torch.Tensor:
    """``sum_s weights[s] * contrast_terms(z, y, targets)[s]`` as one reduction: the
    per-set means' divisors and the weights fold into one (B, S) coefficient that needs
    no gradient, which saves a training step several graph nodes."""
    terms, valid = _sample_terms(z, y, targets)
    coefficient = valid * (targets.weights / valid.sum(dim=0).clamp(min=1))
    return (terms * coefficient).sum()


def prototype_contrast_sets(
    z: torch.Tensor,
    y: torch.Tensor,
    sets: torch.Tensor,
    present: torch.Tensor,
    *,
    tau: float,
    include_positive: bool = False,
) -> torch.Tensor:
    """:func:`prototype_contrast` against each of m prototype sets (m, C, d) with masks
    (m, C) at once: (m,) losses. One batched product instead of m small ones, which is
    what keeps FedPCL's local term affordable in a fleet of a thousand clients."""
    targets = ContrastTargets.build(sets, present, tau=tau, include_positive=include_positive)
    return contrast_terms(z, y, targets)


def fedpcl_targets(
    *,
    global_protos: torch.Tensor,
    global_present: torch.Tensor,
    local_sets: torch.Tensor,
    local_present: torch.Tensor,
    tau: float = 0.07,
    include_positive: bool = False,
) -> ContrastTargets:
    """FedPCL's sets for :func:`fedpcl_loss`: the global set (C, d) first, weight 1, then
    the m (padded) local sets (m, C, d) with masks (m, C), weight 1/m each; m may be 0."""
    m = len(local_sets)
    weights = torch.cat([torch.ones(1), torch.full((m,), 1.0 / max(m, 1))])
    return ContrastTargets.build(
        torch.cat([global_protos[None], local_sets]),
        torch.cat([global_present[None], local_present]),
        tau=tau,
        include_positive=include_positive,
        weights=weights.to(global_protos.dtype),
    )


def fedpcl_loss(z: torch.Tensor, y: torch.Tensor, targets: ContrastTargets) -> torch.Tensor:
    """FedPCL Eq. 8-10 from :func:`fedpcl_targets`: ``L_g`` against the global set (row 0)
    plus ``L_p``, the average of the same term against each client's (padded) local set
    (the other rows; none gives ``L_p`` = 0)."""
    return weighted_contrast(z, y, targets)


def fedproto_loss(
    logits: torch.Tensor,
    z: torch.Tensor,
    y: torch.Tensor,
    *,
    global_protos: torch.Tensor,
    global_present: torch.Tensor,
    lam: float = 1.0,
) -> torch.Tensor:
    """FedProto ("CE + ProtoDist"): cross-entropy of a linear classifier on ``z`` plus
    ``lam * ||z - C_bar_y||^2`` for samples whose class has a global prototype."""
    ce = nn.functional.cross_entropy(logits, y)
    return ce + lam * prototype_distance(z, y, protos=global_protos, present=global_present)


def cpcl_loss(
    z: torch.Tensor,
    y: torch.Tensor,
    *,
    clusters: torch.Tensor,
    cluster_classes: torch.Tensor,
    tau: float = 0.02,
) -> torch.Tensor:
    """FPL's CPCL (Eq. 8): ``-log( sum_{c in P_y} e^{s(z,c)} / sum_{c in P} e^{s(z,c)} )``
    with ``s`` the cosine similarity over ``tau``. ``clusters`` (M, d) are the cluster
    prototypes, ``cluster_classes`` (M,) their classes."""
    s = (
        nn.functional.normalize(z, dim=1) @ nn.functional.normalize(clusters, dim=1).T / tau
    )  # (B, M)
    positive = cluster_classes[None, :] == y[:, None]  # (B, M)
    loss = torch.logsumexp(s, dim=1) - torch.logsumexp(
        s.masked_fill(~positive, float("-inf")), dim=1
    )
    valid = positive.any(dim=1)
    return _masked_mean(torch.where(valid, loss, torch.zeros_like(loss)), valid)


def prototype_distance(
    z: torch.Tensor, y: torch.Tensor, *, protos: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """``||z - C_y||^2`` averaged over the samples whose class has a prototype: FedProto's
    ProtoDist, FPL's UPCR (Eq. 10, against unbiased prototypes) and FedDBP's shared-branch
    alignment (Eq. 3) are all this term."""
    return _masked_mean(((z - protos[y]) ** 2).sum(dim=1), present[y])


def upcr_loss(
    z: torch.Tensor, y: torch.Tensor, *, unbiased: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """FPL's UPCR (Eq. 10): ``sum_v (z_v - U_y,v)^2``, averaged over samples with a U_y."""
    return prototype_distance(z, y, protos=unbiased, present=present)


def feddbp_decision_loss(
    z_d: torch.Tensor,
    y: torch.Tensor,
    *,
    protos: torch.Tensor,
    present: torch.Tensor,
    tau: float = 0.07,
) -> torch.Tensor:
    """FedDBP's decision-branch term with adaptive hard negatives (Eq. 5-6), as printed:

    ``L_d = -1/B sum_i exp(-d_iy/tau) / (sum_c exp(-d_ic/tau) + M_i)``,
    ``M_i = sum_{c != y} exp(-max(0, m - d_ic)/tau)``, ``m = (d_plus + d_minus) / 2``,

    with ``d`` the Euclidean distance between normalised features and normalised
    prototypes and ``d_plus``/``d_minus`` the batch's mean positive/negative distance
    (a batch statistic, held constant in the gradient). Eq. 4-5 carry no logarithm; this
    follows them.
    """
    d = torch.cdist(
        nn.functional.normalize(z_d, dim=1), nn.functional.normalize(protos, dim=1)
    )  # (B, C)
    valid = present[y]
    negatives = present[None, :].expand_as(d).clone()
    negatives[torch.arange(len(y)), y] = False
    pos = d.gather(1, y[:, None]).squeeze(1)
    if not bool(valid.any()) or not bool(negatives[valid].any()):
        return z_d.sum() * 0.0
    margin = ((pos[valid].mean() + d[negatives & valid[:, None]].mean()) / 2).detach()
    hard = torch.exp(-torch.relu(margin - d) / tau).masked_fill(~negatives, 0.0).sum(dim=1)  # M_i
    denominator = torch.exp(-d / tau).masked_fill(~present[None, :], 0.0).sum(dim=1) + hard
    return _masked_mean(-torch.exp(-pos / tau) / denominator, valid)


def fisher_scores(
    classifier: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
) -> torch.Tensor:
    """FedDBP Eq. 8: per class, the mean over its samples of the squared gradient of
    ``log p(y | z)`` with respect to each channel of ``z``. Returns (C, d); a class without
    samples has zeros."""
    z = z.detach().requires_grad_(True)
    log_p = torch.log_softmax(classifier(z), dim=1).gather(1, y[:, None]).sum()
    # Each sample's log-probability depends on its own z only, so the gradient of the sum
    # holds every per-sample gradient.
    (grad,) = torch.autograd.grad(log_p, z)
    squared = grad.detach() ** 2
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype).index_add_(0, y, squared)
    counts = torch.bincount(y, minlength=num_classes).clamp(min=1).to(z.dtype)
    return sums / counts[:, None]
