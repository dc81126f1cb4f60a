"""Local training on a device whose only release is its frozen features (``dp-features``).

After the device's Gaussian release of per-class sums of its clipped backbone features
(and of its per-class counts), nothing trained on its data leaves it. Each round it
receives the coordinator's aggregate of every device's release: global class means in the
frozen feature space and, for FedPCL, every client's noisy means (the local sets of
Eq. 7), all post-processing of DP releases. The device projects them through its own head
to anchors in its embedding space and trains head and classifier with

    L = CE(classifier(z), y) + w * term(z, anchors)

where ``term`` is the method's prototype term: FedPCL's global and local contrast
(Eq. 8-10) or FedProto's distance to the global prototype.

Which ``w``? An anchor can be noisy (a small epsilon) or from other domains, and a weight
that helps one device can hurt another. The device trains a probe per candidate weight on
a fit split of its data, scores each on the rest (its validation split; neither leaves the
device), trains one model per weight on all its data, and predicts with the full-data
model whose probes scored best over the last rounds, by the rule (its classifier, or
cosine similarity to its own local prototypes, FedPCL's rule) that scored best. ``w = 0`` with the
classifier trains and predicts exactly as Solo does (same initialisation, same data
order), and the device leaves it only for a candidate whose probes beat it by at least
one validation sample on average: a device whose held-out data does not say the anchors
help keeps Solo's model. Every model of a kind
sees the same data order (common random numbers), so that two weights differ in their
scores by what the weight does, not by the luck of a shuffle.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edge_agent import inference as inf
from edge_agent import losses
from edge_agent.fit_split import FitSplit
from edge_agent.head import local_prototypes
from edge_agent.methods import device_method
from edge_agent.state import npz_bytes
from edge_agent.train import (
    Guidance,
    LocalModel,
    LossFn,
    RoundMetrics,
    make_optimiser,
    train_round,
)
from edge_agent.train_config import TrainConfig
from protocol import RoundAnnouncement
from runtime.files import atomic_write

log = logging.getLogger(__name__)


def project(model: LocalModel, means: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Feature-space means (..., D) -> unit anchors (..., d) through ``model``'s head.

    The means are of clipped (norm <= 1) features while the head trains on the raw ones:
    each mean's direction is scaled to ``scale``, the typical norm of this device's own
    features, so the head sees an input of the size it was trained on. Eval mode: the
    anchors are targets, not a batch to normalise or to train through."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        flat = means.reshape(-1, means.shape[-1])
        z = model.head(nn.functional.normalize(flat, dim=1) * scale)
    model.train(was_training)
    return z.reshape(*means.shape[:-1], z.shape[-1])


def anchors(
    model: LocalModel,
    announcement: RoundAnnouncement,
    *,
    client: str,
    feature_dim: int,
    out_dim: int,
    scale: float,
) -> Guidance:
    """The announcement's feature-space prototypes as this model's embedding anchors."""
    feature_space = Guidance.from_announcement(announcement, client=client, dim=feature_dim)
    if not feature_space.has_globals:
        return Guidance.empty(len(announcement.classes), out_dim)
    return Guidance(
        project(model, feature_space.global_protos, scale=scale),
        feature_space.global_present,
        project(model, feature_space.local_sets, scale=scale),
        feature_space.local_present,
    )


def anchored_loss(method: str, weight: float) -> LossFn:
    """Cross-entropy through the classifier plus ``weight`` times the method's term."""
    anchor = device_method(method).anchor
    if anchor is None:
        raise ValueError(f"{method} takes no feature-space anchors")

    def loss(
        model: LocalModel, r: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
    ) -> torch.Tensor:
        z, logits = model(r)
        out = nn.functional.cross_entropy(logits, y)
        if weight == 0 or not g.has_globals:
            return out
        if anchor == "contrast":
            targets = g.fedpcl_targets(tau=cfg.tau, include_positive=cfg.include_positive)
            term = losses.fedpcl_loss(z, y, targets)
        else:  # "distance": FedProto's ProtoDist
            term = losses.prototype_distance(z, y, protos=g.global_protos, present=g.global_present)
        return out + weight * term

    return loss


#: How a candidate predicts (keys of ``edge_agent.inference.RULES``): by its classifier
#: (Solo's rule) or by cosine similarity to the device's own local prototypes (FedPCL's).
RULES = ("classifier", "local_prototype_cosine")


def rule_accuracies(
    model: LocalModel,
    fit_x: np.ndarray,
    fit_y: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
) -> tuple[float, ...]:
    """Accuracy on (x, y) by each of :data:`RULES`, prototypes from (fit_x, fit_y): the
    inference functions the device predicts with."""
    if len(y) == 0:
        return (0.0,) * len(RULES)
    fit = inf.outputs_of(model, fit_x)
    protos, counts = local_prototypes(torch.from_numpy(fit.z), torch.from_numpy(fit_y), num_classes)
    refs = inf.References(local=protos.numpy(), local_present=counts.numpy() > 0)
    out = inf.outputs_of(model, x)
    return tuple(inf.accuracy(inf.RULES[rule](out, refs), y) for rule in RULES)


@dataclass(frozen=True)
class Choice:
    weight: float
    rule: str  # one of RULES
    val_accuracies: tuple[tuple[float, ...], ...]  # per candidate weight, per rule


class AnchoredLearner:
    """The models a dp-features device trains: a probe (fit split) and a full-data model
    per candidate weight. The full model of weight 0 is the agent's own ``model``,
    trained with the agent's data-order generator, as Solo's is."""

    FILE = "anchored.npz"

    def __init__(
        self,
        *,
        model: LocalModel,
        method: str,
        weights: tuple[float, ...],
        cfg: TrainConfig,
        features: np.ndarray,
        labels: np.ndarray,
        split: FitSplit,
        seed: int,
        state_dir: Path,
    ) -> None:
        self.method, self.cfg, self.path = method, cfg, state_dir / self.FILE
        self.weights = tuple(sorted(set(weights)))
        self.split = split
        self.fit_x = np.asarray(features[split.fit], dtype=np.float32)
        self.fit_y = np.asarray(labels[split.fit])
        self.val_x = np.asarray(features[split.val], dtype=np.float32)
        self.val_y = np.asarray(labels[split.val])
        # Scale of this device's own features: the size the head expects an input to be.
        rows = np.asarray(features[: min(len(features), 4096)], dtype=np.float32)
        self.scale = float(np.median(np.linalg.norm(rows, axis=1))) if len(rows) else 1.0
        self.probes = [copy.deepcopy(model) for _ in self.weights]
        self.fulls = [model if w == 0 else copy.deepcopy(model) for w in self.weights]
        self.optimisers = {id(m): make_optimiser(m, cfg) for m in [*self.probes, *self.fulls]}
        self.probe_order = torch.Generator().manual_seed(seed + 7919)
        # (rounds, weights, rules): the probes' validation accuracy
        self.scores = np.zeros((0, len(self.weights), len(RULES)))
        self.chosen, self.rule = 0, 0
        self.resumed = self._load()

    def train_round(
        self,
        features: np.ndarray,
        labels: np.ndarray,
        announcement: RoundAnnouncement,
        *,
        client: str,
        generator: torch.Generator,
        optimiser: torch.optim.Optimizer,
    ) -> tuple[RoundMetrics, Choice]:
        """One round of every model; ``generator`` and ``optimiser`` are the agent's own,
        for its own model (weight 0's full-data model)."""
        feature_dim, out_dim = features.shape[1], self.cfg.out_dim
        # Common random numbers: this round's data order, the same for every weight.
        full_order, probe_order = generator.get_state(), self.probe_order.get_state()
        scores: list[tuple[float, ...]] = []
        metrics: RoundMetrics | None = None
        for k, weight in enumerate(self.weights):
            loss = anchored_loss(self.method, weight)
            runs = (
                (self.probes[k], self.fit_x, self.fit_y, self.probe_order, probe_order),
                (self.fulls[k], features, labels, generator, full_order),
            )
            for model, x, y, gen, state in runs:
                own = model is self.fulls[0] and weight == 0
                gen.set_state(state)
                guide = anchors(model, announcement, client=client, feature_dim=feature_dim,
                                out_dim=out_dim, scale=self.scale)  # fmt: skip
                m = train_round(
                    model,
                    optimiser if own else self.optimisers[id(model)],
                    x,
                    y,
                    method=self.method,
                    guidance=guide,
                    cfg=self.cfg,
                    generator=gen,
                    loss=loss,
                )
                if model is self.fulls[k] and (metrics is None or own):
                    metrics = m
            scores.append(rule_accuracies(self.probes[k], self.fit_x, self.fit_y, self.val_x,
                                          self.val_y, len(announcement.classes)))  # fmt: skip
        self.scores = np.concatenate([self.scores, np.array(scores)[None]])
        self.chosen, self.rule = self._choose()
        assert metrics is not None
        return metrics, Choice(self.weights[self.chosen], RULES[self.rule], tuple(scores))

    #: Rounds of validation scores a choice rests on.
    WINDOW = 5

    def _choose(self) -> tuple[int, int]:
        """(weight, rule) whose probes scored best on average over the last rounds; weight
        0 by the classifier (Solo) unless another beats it by one validation sample."""
        recent = self.scores[-self.WINDOW :].mean(axis=0)  # (weights, rules)
        candidates = [(k, r) for k in range(len(self.weights)) for r in range(len(RULES))]
        # On a tie: the smaller weight, then the classifier.
        best = max(candidates, key=lambda c: (recent[c], -self.weights[c[0]], -c[1]))
        margin = 1 / max(1, len(self.val_y)) - 1e-9
        if self.weights[0] == 0 and recent[best] - recent[0, 0] < margin:
            return 0, 0
        return best

    @property
    def predict_rule(self) -> str:
        """How the chosen model predicts: one of :data:`RULES`."""
        return RULES[self.rule]

    @property
    def model(self) -> LocalModel:
        """The full-data model the device predicts with."""
        return self.fulls[self.chosen]

    def save(self) -> None:
        arrays: dict[str, np.ndarray] = {
            "chosen": np.array(self.chosen),
            "rule": np.array(self.rule),
            "scores": self.scores,
            # The probes' data order, so that a restarted device shuffles as it would have.
            "probe_order": self.probe_order.get_state().numpy(),
        }
        for kind, models in (("probe", self.probes), ("full", self.fulls)):
            for k, m in enumerate(models):
                for name, v in m.state_dict().items():
                    arrays[f"{kind}{k}/{name}"] = v.detach().cpu().numpy()
        atomic_write(self.path, npz_bytes(arrays))

    def _load(self) -> bool:
        if not self.path.exists():
            return False
        try:
            with np.load(self.path, allow_pickle=False) as data:
                for kind, models in (("probe", self.probes), ("full", self.fulls)):
                    for k, m in enumerate(models):
                        prefix = f"{kind}{k}/"
                        state = {n[len(prefix):]: torch.from_numpy(data[n])
                                 for n in data.files if n.startswith(prefix)}  # fmt: skip
                        m.load_state_dict(state, strict=True)
                scores = data["scores"]
                if scores.shape[1:] != (len(self.weights), len(RULES)):
                    raise ValueError("validation scores of other candidate weights")
                self.scores = scores
                self.probe_order.set_state(torch.from_numpy(data["probe_order"].copy()))
                self.chosen = min(int(data["chosen"]), len(self.weights) - 1)
                self.rule = min(int(data["rule"]), len(RULES) - 1)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            log.warning("%s does not fit the configured models, starting anew: %s", self.path, exc)
            return False
        return True
