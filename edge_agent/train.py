"""One round of local training on cached features, and the prototypes it yields.

``train_round(model, features, labels, method=..., guidance=..., cfg=...)`` reads straight
down: shuffle, embed, loss from the method's registry entry, step. Backbones never run
here: ``features`` are the cached ``r_x`` (N, K*d_e).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from edge_agent import losses
from edge_agent.head import ProjectionHead, local_prototypes
from edge_agent.train_config import TrainConfig
from protocol import RoundAnnouncement


class LocalModel(nn.Module):
    """The trainable part on a device: the projection head and a linear classifier on
    ``z`` (used by the methods with a cross-entropy term, and by FedAvg)."""

    def __init__(
        self, *, in_dim: int, num_classes: int, cfg: TrainConfig, dual: bool = False
    ) -> None:
        super().__init__()
        self.head = ProjectionHead(in_dim=in_dim, out_dim=cfg.out_dim, norm=cfg.norm)
        self.classifier = nn.Linear(cfg.out_dim, num_classes)
        self.bounded = cfg.classifier == "bounded"
        # FedDBP's decision branch; ``head`` is then its shared branch.
        self.decision = (
            ProjectionHead(in_dim=in_dim, out_dim=cfg.out_dim, norm=cfg.norm) if dual else None
        )

    def forward(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.head(r)  # (B, out_dim), unit norm
        return z, self.logits(z)  # (B, C)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        out = self.classifier(z)
        if self.bounded:
            # Outside the Linear module: Opacus pairs the module's output gradient with
            # its input, which must stay the Linear layer's own.
            out = nn.functional.normalize(nn.functional.relu(out), dim=1)
        return out


@dataclass(frozen=True)
class Guidance:
    """What the round announcement contributes to the local objective, as tensors."""

    global_protos: torch.Tensor  # (C, d)
    global_present: torch.Tensor  # (C,) bool
    local_sets: torch.Tensor  # (m, C, d)
    local_present: torch.Tensor  # (m, C) bool
    clusters: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))  # (M, d)
    cluster_classes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # FedPCL's prepared sets, built at the first step of a round and reused by the rest.
    _targets: dict[tuple[float, bool], losses.ContrastTargets] = field(
        default_factory=dict, compare=False, repr=False
    )
    # Asked at every step; answered once (a tensor reduction and a sync each time otherwise).
    has_globals: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "has_globals", bool(self.global_present.any()))

    def fedpcl_targets(self, *, tau: float, include_positive: bool) -> losses.ContrastTargets:
        key = (tau, include_positive)
        if key not in self._targets:
            self._targets[key] = losses.fedpcl_targets(
                global_protos=self.global_protos,
                global_present=self.global_present,
                local_sets=self.local_sets,
                local_present=self.local_present,
                tau=tau,
                include_positive=include_positive,
            )
        return self._targets[key]

    @classmethod
    def empty(cls, num_classes: int, dim: int) -> Guidance:
        return cls(
            global_protos=torch.zeros(num_classes, dim),
            global_present=torch.zeros(num_classes, dtype=torch.bool),
            local_sets=torch.zeros(0, num_classes, dim),
            local_present=torch.zeros(0, num_classes, dtype=torch.bool),
        )

    @classmethod
    def from_announcement(
        cls, announcement: RoundAnnouncement, *, client: str, dim: int
    ) -> Guidance:
        """Scatter the announcement's rows (aligned with ``global_classes``) into dense
        (C, d) tensors. A dimension other than ``dim`` (another head size) is ignored."""
        num_classes = len(announcement.classes)
        guide = cls.empty(num_classes, dim)
        rows = announcement.global_of(client)
        if len(announcement.global_classes) == 0 or rows.shape[1] != dim:
            return guide
        idx = torch.tensor(announcement.global_classes, dtype=torch.long)
        guide.global_protos[idx] = torch.from_numpy(rows.astype(np.float32))
        guide.global_present[idx] = True
        sets = [s for s in announcement.local_sets.values() if s.shape == rows.shape]
        local = torch.zeros(len(sets), num_classes, dim)
        present = torch.zeros(len(sets), num_classes, dtype=torch.bool)
        for p, s in enumerate(sets):
            local[p, idx] = torch.from_numpy(s.astype(np.float32))
            present[p, idx] = True
        clusters = announcement.extras.get("clusters")
        owners = announcement.extras.get("cluster_classes")
        if (
            clusters is not None
            and owners is not None
            and clusters.ndim == 2
            and clusters.shape[1] == dim
        ):
            return cls(
                guide.global_protos,
                guide.global_present,
                local,
                present,
                torch.from_numpy(clusters.astype(np.float32)),
                torch.from_numpy(owners.astype(np.int64)),
            )
        return cls(guide.global_protos, guide.global_present, local, present)


EmbeddingLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Guidance, TrainConfig], torch.Tensor
]
LossFn = Callable[[LocalModel, torch.Tensor, torch.Tensor, Guidance, TrainConfig], torch.Tensor]


def _on_embeddings(fn: EmbeddingLoss) -> LossFn:
    """Adapt a loss of (z, logits, y, guidance, cfg) to the model-level signature."""

    def loss(
        model: LocalModel, r: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
    ) -> torch.Tensor:
        z, logits = model(r)
        return fn(z, logits, y, g, cfg)

    return loss


def _fedpcl_model(
    model: LocalModel, r: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
) -> torch.Tensor:
    # FedPCL has no classifier: the head alone, without the unused logits, per step.
    return fedpcl_objective(model.head(r), y, g, cfg)


def fedpcl_objective(
    z: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
) -> torch.Tensor:
    """FedPCL's objective on embeddings z; DP-SGD calls it directly (privacy.dpsgd)."""
    if not g.has_globals:
        # Round 0 has no prototypes yet: contrast against this batch's own class means
        # (detached), the local-only form of the same objective.
        protos, counts = local_prototypes(z.detach(), y, len(g.global_present))
        return losses.prototype_contrast(
            z, y, protos, counts > 0, tau=cfg.tau, include_positive=cfg.include_positive
        )
    targets = g.fedpcl_targets(tau=cfg.tau, include_positive=cfg.include_positive)
    return losses.fedpcl_loss(z, y, targets)


def _fedproto(
    z: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
) -> torch.Tensor:
    return losses.fedproto_loss(
        logits, z, y, global_protos=g.global_protos, global_present=g.global_present, lam=cfg.lam
    )


def _fpl(
    z: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
) -> torch.Tensor:
    # FPL's objective: cross-entropy + CPCL (Eq. 8) + UPCR (Eq. 10, against the unbiased
    # prototypes the coordinator announces as global prototypes).
    loss = nn.functional.cross_entropy(logits, y)
    if g.clusters.numel():
        loss = loss + losses.cpcl_loss(
            z, y, clusters=g.clusters, cluster_classes=g.cluster_classes, tau=cfg.fpl_tau
        )
    if g.has_globals:
        loss = loss + losses.upcr_loss(z, y, unbiased=g.global_protos, present=g.global_present)
    return loss


def _cross_entropy(
    z: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y)


def _feddbp(
    model: LocalModel, r: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
) -> torch.Tensor:
    # FedDBP Eq. 7: L = L_sCE + l1 L_dCE + l2 L_s + l3 L_d. The shared branch (``head``)
    # yields the uploaded prototypes; the decision branch is trained contrastively
    # against this client's (personalised) global prototypes.
    if model.decision is None:
        raise ValueError("FedDBP needs a LocalModel built with dual=True")
    z_s, logits_s = model(r)
    z_d = model.decision(r)
    loss = nn.functional.cross_entropy(logits_s, y) + cfg.dbp_lambda1 * nn.functional.cross_entropy(
        model.logits(z_d), y
    )
    if g.has_globals:
        loss = loss + cfg.dbp_lambda2 * losses.prototype_distance(  # Eq. 3
            z_s, y, protos=g.global_protos, present=g.global_present
        )
        loss = loss + cfg.dbp_lambda3 * losses.feddbp_decision_loss(
            z_d, y, protos=g.global_protos, present=g.global_present, tau=cfg.tau
        )
    return loss


#: Local objectives by method name. Solo and FedAvg train head and classifier with
#: cross-entropy; FedAvg's weights are then averaged by the coordinator.

LOSSES: dict[str, LossFn] = {
    "fedpcl": _fedpcl_model,
    "fedproto": _on_embeddings(_fedproto),
    "fpl": _on_embeddings(_fpl),
    "feddbp": _feddbp,
    "solo": _on_embeddings(_cross_entropy),
    "fedavg": _on_embeddings(_cross_entropy),
}


def loss_for(method: str) -> LossFn:
    try:
        return LOSSES[method]
    except KeyError:
        raise ValueError(
            f"no local objective for method {method!r}; available: {', '.join(sorted(LOSSES))}"
        ) from None


@dataclass(frozen=True)
class RoundMetrics:
    loss: float
    samples: int
    steps: int
    seconds: float


def train_round(
    model: LocalModel,
    optimiser: torch.optim.Optimizer,
    features: np.ndarray,
    labels: np.ndarray,
    *,
    method: str,
    guidance: Guidance,
    cfg: TrainConfig,
    generator: torch.Generator,
    loss: LossFn | None = None,
) -> RoundMetrics:
    """E epochs of the method's local objective (or of ``loss``) over the cached features."""
    loss_fn = loss or loss_for(method)
    start = time.perf_counter()
    y_all = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    n = len(y_all)
    total, steps = 0.0, 0
    params = [p for group in optimiser.param_groups for p in group["params"]]
    model.train()
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator)
        for i in range(0, n, cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            if len(idx) < 2:
                continue  # BatchNorm cannot normalise a single sample
            r = torch.from_numpy(np.asarray(features[idx.numpy()], dtype=np.float32))  # (B, K*d_e)
            value = loss_fn(model, r, y_all[idx], guidance, cfg)
            for p in params:  # zero_grad(set_to_none=True) without its per-call bookkeeping
                p.grad = None
            value.backward()
            optimiser.step()
            total += float(value.detach())
            steps += 1
    for p in params:
        # The last step's gradients would otherwise sit in memory until the next round:
        # a head's worth per agent, 0.9 GB over a 1,000-device fleet in one process.
        p.grad = None
    return RoundMetrics(
        loss=total / max(steps, 1), samples=n, steps=steps, seconds=time.perf_counter() - start
    )


def make_optimiser(model: LocalModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    # The fused kernel updates every parameter in one call: a 32-step epoch of this small
    # head is dominated by per-op overhead, and fused Adam cuts the epoch by about 30%.
    try:
        return torch.optim.Adam(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
        )
    except (RuntimeError, TypeError):  # a build without the fused CPU kernel
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


@torch.inference_mode()
def embed(
    model: LocalModel, features: np.ndarray, *, batch: int = 512
) -> tuple[np.ndarray, np.ndarray]:
    """(z, logits) of every sample in eval mode."""
    model.eval()
    z, logits = in_batches(model, features, batch=batch)
    return z, logits


@torch.inference_mode()
def in_batches(
    fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]],
    features: np.ndarray,
    *,
    batch: int = 512,
) -> tuple[np.ndarray, ...]:
    """``fn``'s output(s) for every row of ``features``, ``batch`` rows at a time, each
    batch copied off the memmap as float32."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for i in range(0, len(features), batch):
        out = fn(torch.from_numpy(np.array(features[i : i + batch], dtype=np.float32)))
        parts.append(out if isinstance(out, tuple) else (out,))
    return tuple(np.concatenate([p[k].numpy() for p in parts]) for k in range(len(parts[0])))


def prototypes_of(
    model: LocalModel, features: np.ndarray, labels: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """FedPCL Eq. 5 on the whole local set: (C, d) prototypes and (C,) counts."""
    z, _ = embed(model, features)
    protos, counts = local_prototypes(
        torch.from_numpy(z), torch.from_numpy(np.asarray(labels, dtype=np.int64)), num_classes
    )
    return protos.numpy(), counts.numpy()
