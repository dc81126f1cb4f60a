"""The local objectives as pure functions of embeddings, labels and prototypes.

Shapes: ``z`` (B, d) unit-norm embeddings, ``y`` (B,) class indices, prototype sets
(C, d) with a (C,) boolean ``present`` mask for classes that have a prototype.
A sample whose own class has no prototype contributes nothing to a prototype term.
"""

from __future__ import annotations

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
    m, batch = sets.shape[0], len(y)
    logits = torch.einsum("bd,mcd->mbc", z, sets) / tau  # (m, B, C)
    positive = logits.gather(2, y[None, :, None].expand(m, batch, 1)).squeeze(2)  # (m, B)
    others = present[:, None, :].expand(m, batch, -1).clone()
    if not include_positive:
        others[:, torch.arange(batch), y] = False
    # A large finite negative instead of -inf: a row with no negatives then has a finite
    # (masked-out) value and a finite gradient, where -inf would give NaN through softmax.
    masked = logits.masked_fill(~others, torch.finfo(logits.dtype).min / 4)
    denominator = torch.logsumexp(masked, dim=2)  # (m, B)
    valid = present.gather(1, y[None, :].expand(m, batch)) & others.any(dim=2)
    loss = torch.where(valid, denominator - positive, torch.zeros_like(positive))
    return (loss * valid).sum(dim=1) / valid.sum(dim=1).clamp(min=1)


def fedpcl_loss(
    z: torch.Tensor,
    y: torch.Tensor,
    *,
    global_protos: torch.Tensor,
    global_present: torch.Tensor,
    local_sets: torch.Tensor,
    local_present: torch.Tensor,
    tau: float = 0.07,
    include_positive: bool = False,
) -> torch.Tensor:
    """FedPCL Eq. 8-10: ``L_g`` against the global set plus ``L_p``, the average of the
    same term against each client's (padded) local set. ``local_sets`` is (m, C, d) with
    ``local_present`` (m, C); m may be 0 (then ``L_p`` is 0)."""
    l_g = prototype_contrast(
        z, y, global_protos, global_present, tau=tau, include_positive=include_positive
    )
    if local_sets.shape[0] == 0:
        return l_g
    l_p = prototype_contrast_sets(
        z, y, local_sets, local_present, tau=tau, include_positive=include_positive
    ).mean()
    return l_g + l_p


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
    classifier: nn.Module, z: torch.Tensor, y: torch.Tensor, num_classes: int
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
