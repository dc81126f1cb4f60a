"""How each method predicts a class, as its paper states it: one function per rule, in a
registry keyed by rule name, and the method -> rule table.

A device's score on its test split (:mod:`edge_agent.evaluation`, and the simulated
fleet's :mod:`fleet.engine.evaluation` over it) and ``edge-agent predict`` both call
:func:`predict`, so a device predicts exactly the way it was scored.

The math is pure functions on plain arrays (:func:`nearest_by_cosine`,
:func:`nearest_by_distance`, :func:`argmax_logits`); the rules pick which model output
and which prototypes they compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edge_agent.methods import MethodRule, device_method

if TYPE_CHECKING:
    from edge_agent.state import StateDir
    from protocol import RoundAnnouncement

# torch is imported inside the functions that run a model: the registry and the pure math
# are read by report code that should not pay for it.


class MissingReference(ValueError):
    """The rule needs prototypes the device does not hold yet (no round answered, or no
    global prototypes announced)."""


@dataclass(frozen=True)
class Outputs:
    """A model's outputs on N samples, computed once and shared by every rule."""

    z: np.ndarray  # (N, d) the projection head's output, unit norm
    logits: np.ndarray  # (N, C) the classifier on z
    z_decision: np.ndarray | None = None  # (N, d) FedDBP's decision branch, unit norm


@dataclass(frozen=True)
class References:
    """The prototypes a device predicts against: its own (local, Eq. 5 of FedPCL) and the
    last global set the coordinator sent it (this client's personalised set where the
    strategy makes one). ``*_present`` (C,) marks the classes that have a prototype."""

    local: np.ndarray | None = None  # (C, d)
    local_present: np.ndarray | None = None  # (C,) bool
    global_: np.ndarray | None = None  # (C, d)
    global_present: np.ndarray | None = None  # (C,) bool

    def local_set(self) -> tuple[np.ndarray, np.ndarray]:
        if self.local is None or self.local_present is None or not self.local_present.any():
            raise MissingReference("no local prototypes yet: the device has answered no round")
        return self.local, self.local_present

    def global_set(self) -> tuple[np.ndarray, np.ndarray]:
        if self.global_ is None or self.global_present is None or not self.global_present.any():
            raise MissingReference(
                "no global prototypes yet: the coordinator has announced none to this device"
            )
        return self.global_, self.global_present


@dataclass(frozen=True)
class Prediction:
    classes: np.ndarray  # (N,) int64 class indices
    scores: np.ndarray  # (N,) the rule's score of the chosen class (higher is better)


# -- the math ----------------------------------------------------------------------------------


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norm, 1e-12)


def _best(scores: np.ndarray, present: np.ndarray) -> Prediction:
    masked = np.where(present[None, :], scores, -np.inf)  # (N, C)
    classes = masked.argmax(axis=1)
    return Prediction(classes.astype(np.int64), masked[np.arange(len(classes)), classes])


def nearest_by_cosine(z: np.ndarray, protos: np.ndarray, present: np.ndarray) -> Prediction:
    """The present class whose prototype has the largest cosine similarity with each row
    of ``z`` (both sides normalised: a prototype's length, which shrinks as its class's
    embeddings spread, does not count). Score: the cosine."""
    return _best(_unit(z) @ _unit(protos).T, present)


def nearest_by_distance(z: np.ndarray, protos: np.ndarray, present: np.ndarray) -> Prediction:
    """The present class whose prototype is nearest to each row of ``z`` in Euclidean
    distance. Score: minus the distance."""
    # ||z - c||^2 = ||z||^2 - 2 z.c + ||c||^2, without an (N, C, d) intermediate.
    squared = (
        (z * z).sum(axis=1, keepdims=True) - 2.0 * z @ protos.T + (protos * protos).sum(axis=1)
    )
    return _best(-np.sqrt(np.maximum(squared, 0.0)), present)


def argmax_logits(logits: np.ndarray) -> Prediction:
    """The class with the largest logit. Score: that logit."""
    classes = logits.argmax(axis=1)
    return Prediction(classes.astype(np.int64), logits[np.arange(len(classes)), classes])


# -- the rules ---------------------------------------------------------------------------------

Rule = Callable[[Outputs, References], Prediction]


def local_prototype_cosine(out: Outputs, refs: References) -> Prediction:
    # FedPCL Sec. 4, "Prototype-based Inference": "we first calculate the similarity
    # scores between the output of projection network and every local prototypes. Then,
    # the predicted result is the class with the maximum similarity score." The score is
    # the cosine similarity of the normalised output and the normalised local prototype:
    # z has unit norm (Table 7's head), a local prototype (a mean of unit vectors) does
    # not, and a plain dot product would favour the classes whose embeddings agree most.
    return nearest_by_cosine(out.z, *refs.local_set())


def global_prototype_distance(out: Outputs, refs: References) -> Prediction:
    # FedProto (Tan et al., AAAI 2022), Sec. 3 "Prototype-based model inference":
    # y = argmin_j ||f(phi; x) - C^(j)||_2, the L2 distance between the representation and
    # the class prototype C^(j) of the federation (the global set the server averages).
    # FedPCL compares against FedProto (Sec. 5.1) without restating its inference, and
    # the FedProto paper is not among shared/papers: the rule is quoted from it here.
    return nearest_by_distance(out.z, *refs.global_set())


def decision_global_distance(out: Outputs, refs: References) -> Prediction:
    # FedDBP Sec. 3.1: "we employ the decision feature z_d from the decision branch g_d
    # to perform prototype-based inference", with Eq. 4's distance d_{i,c}: Euclidean,
    # between the normalised decision feature and the normalised global class prototype.
    # The paper does not say which prototype set inference uses; we take the one its
    # decision loss trains z_d towards: the (Fisher-personalised, Eq. 9-10) global set the
    # coordinator sent this client.
    if out.z_decision is None:
        raise ValueError("the decision-branch rule needs a model with a decision branch")
    protos, present = refs.global_set()
    return nearest_by_distance(_unit(out.z_decision), _unit(protos), present)


def classifier(out: Outputs, refs: References) -> Prediction:
    # Solo and FedAvg (FedPCL Sec. 5.1's baselines) predict with their classifier. The FPL
    # paper (CVPR 2023) states no inference rule of its own: its model is a feature
    # extractor and a "unified classifier" (Sec. 3.1) meant as "a generalizable global
    # model", and it reports Top-1 accuracy (Sec. 4.1). We take that global model's
    # classifier; FPL's prototypes shape its training only. FedAvg's and FPL's classifier
    # is the global model's (see edge_agent/methods.py).
    return argmax_logits(out.logits)


#: Inference rules by name.
RULES: dict[str, Rule] = {
    "local_prototype_cosine": local_prototype_cosine,
    "global_prototype_distance": global_prototype_distance,
    "decision_global_distance": decision_global_distance,
    "classifier": classifier,
}


def rule_of(method: str) -> MethodRule:
    """How ``method`` predicts (its record's rule, ``edge_agent/methods.py``)."""
    return device_method(method).rule


# -- running a model ---------------------------------------------------------------------------


def outputs_of(model: object, features: np.ndarray, *, batch: int = 512) -> Outputs:
    """The outputs of a ``LocalModel`` (eval mode) on cached features ``(N, K*d_e)``."""
    from edge_agent.train import LocalModel, embed, in_batches  # torch: not for --help, reports

    assert isinstance(model, LocalModel)
    z, logits = embed(model, features, batch=batch)
    z_decision = None
    if model.decision is not None:
        (z_decision,) = in_batches(model.decision, features, batch=batch)  # eval mode: embed
    return Outputs(z=z, logits=logits, z_decision=z_decision)


def check_references(method: str, refs: References) -> None:
    """Raise :class:`MissingReference` if ``refs`` lack the prototypes ``method``'s rule
    compares against."""
    kind = rule_of(method).prototypes
    if kind == "local":
        refs.local_set()
    elif kind == "global":
        refs.global_set()


def predict(method: str, outputs: Outputs, refs: References) -> Prediction:
    """``method``'s prediction: the one function the fleet's evaluation and ``edge-agent
    predict`` share. Raises :class:`MissingReference` before the prototypes it needs exist."""
    return RULES[rule_of(method).rule](outputs, refs)


def accuracy(prediction: Prediction, labels: np.ndarray) -> float:
    return float((prediction.classes == np.asarray(labels)).mean())


# -- what a device holds -----------------------------------------------------------------------


def dense_globals(
    announcement: RoundAnnouncement, *, client: str, num_classes: int, dim: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The announcement's global prototypes for ``client`` (its personalised set where
    there is one) as a dense (C, d) float32 array and a (C,) mask; None when it carries
    none of this head's size."""
    rows = announcement.global_of(client)
    if len(announcement.global_classes) == 0 or rows.ndim != 2 or rows.shape[1] != dim:
        return None
    protos = np.zeros((num_classes, dim), dtype=np.float32)
    present = np.zeros(num_classes, dtype=bool)
    idx = np.asarray(announcement.global_classes, dtype=np.int64)
    protos[idx] = rows.astype(np.float32)
    present[idx] = True
    return protos, present


def stored_references(state: StateDir) -> References:
    """The prototypes a device's state folder holds: what ``edge-agent predict`` and the
    score of a method predicting with the coordinator's output both use."""
    local = state.load_prototypes()
    glob = state.load_globals()
    return References(
        local=None if local is None else local[0],
        local_present=None if local is None else local[1] > 0,
        global_=None if glob is None else glob[0],
        global_present=None if glob is None else glob[1].astype(bool),
    )
