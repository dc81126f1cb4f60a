"""Time to accuracy for the Flower side by side (bench/peer_bench.py): how a run's global
model is scored, and how long the run took to reach its own final accuracy.

Every engine is scored the same way: the one global model a round ends with (FedAvg's
averaged head and classifier, or lda's fleet head as the coordinator announces it), its
top-1 accuracy over the workload's held-out test rows (``Workload.test_rows``), scored
after the run so that scoring is no part of any round's time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bench.peer_workload import Workload
from closed_form.projection import prepare, projection
from edge_agent.closed_form import global_head
from edge_agent.extras import fitting_weights
from edge_agent.train import LocalModel, embed
from edge_agent.train_config import TrainConfig
from protocol import RoundAnnouncement

#: How close to its final accuracy a run must come to have reached it: one point.
TOLERANCE = 0.01


@dataclass(frozen=True)
class Reached:
    """When a run first came within ``tolerance`` of its final accuracy ``final``: after
    ``rounds`` rounds, ``seconds`` of them (their times summed, the first round's
    included), at ``accuracy``."""

    seconds: float
    rounds: int
    accuracy: float
    final: float


def time_to_target(
    seconds: Sequence[float], accuracies: Sequence[float], *, tolerance: float = TOLERANCE
) -> Reached:
    """Round r's wall time is ``seconds[r]`` and the accuracy of the model it ended with
    ``accuracies[r]``; the target is the last round's accuracy less ``tolerance``, and the
    run reached it at the end of the first round scoring at least that.

    >>> time_to_target([3.0, 2.0, 2.0, 2.0], [0.5, 0.79, 0.81, 0.80], tolerance=0.01)
    Reached(seconds=5.0, rounds=2, accuracy=0.79, final=0.8)
    """
    if len(seconds) != len(accuracies) or not seconds:
        raise ValueError("need one accuracy per round and at least one round")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if not all(math.isfinite(v) and v >= 0 for v in seconds):
        raise ValueError("every round's seconds must be finite and >= 0")
    if not all(math.isfinite(a) for a in accuracies):
        raise ValueError("every round needs a finite accuracy: a missing score is no score")
    final = float(accuracies[-1])
    # The last round always qualifies, so there is a first one.
    r = next(i for i, a in enumerate(accuracies) if a >= final - tolerance)
    return Reached(seconds=float(sum(seconds[: r + 1])), rounds=r + 1,
                   accuracy=float(accuracies[r]), final=final)  # fmt: skip


def _test_set(workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    if workload.test_rows.size == 0:
        raise ValueError("the workload holds no test rows to score on")
    return workload.features[workload.test_rows], workload.test_labels


def head_accuracy(weights: Mapping[str, np.ndarray], workload: Workload) -> float:
    """Top-1 accuracy on the test rows of the head and classifier ``weights`` (state-dict
    names, as FedAvg's announcement or Flower's parameters carry them), the model each
    FedAvg client of ``workload`` trains (edge_agent.train.LocalModel)."""
    cfg = TrainConfig(epochs=workload.epochs, batch_size=workload.batch_size)
    model = LocalModel(in_dim=workload.dim, num_classes=workload.num_classes, cfg=cfg)
    state = model.state_dict()
    fitting = fitting_weights(state, weights)
    # Every floating-point entry (BatchNorm's batch count, which eval mode does not read,
    # is not averaged by the vector engine): a head half loaded would score a model
    # nobody trained.
    lacking = sorted(k for k, v in state.items() if v.is_floating_point() and k not in fitting)
    if lacking:
        raise ValueError(f"weights lack {lacking}")
    model.load_state_dict(fitting, strict=False)
    features, labels = _test_set(workload)
    return float((embed(model, features)[1].argmax(axis=1) == labels).mean())


def closed_form_accuracy(
    announcement: RoundAnnouncement, workload: Workload, *, fleet: str, dim: int
) -> float:
    """Top-1 accuracy on the test rows of the fleet head ``announcement`` carries (a
    closed-form method's, at ``dim`` features after the fleet's public projection), as
    every device receives it, before any device personalises it."""
    head = global_head(announcement, num_classes=workload.num_classes, dim=dim)
    if head is None:
        raise ValueError(f"announcement of round {announcement.round} carries no head")
    features, labels = _test_set(workload)
    q = projection(fleet, workload.dim, dim)
    return float((head.scores(prepare(features, q)).argmax(axis=1) == labels).mean())
