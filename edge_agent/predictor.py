"""What ``edge-agent predict`` predicts with, as the device's rounds were scored: the rule
(its method's, or the one its privacy mode keeps: a dp-features device's validation split
chooses its own) and the model (its head checkpoint, or a closed-form method's chosen
linear head). Imports torch: the command line loads this module only once it predicts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edge_agent import inference
from edge_agent.closed_form import ClosedFormDevice, StoredHead
from edge_agent.config import AgentConfig
from edge_agent.methods import device_method
from edge_agent.privacy.modes import mode_class
from edge_agent.state import StateDir
from edge_agent.train import LocalModel

#: A predictor: backbone features (N, K*d_e) -> the outputs its rule compares.
Outputs = Callable[[np.ndarray], inference.Outputs]


class PredictorError(ValueError):
    """The state folder holds nothing this configuration can predict with (yet)."""


def rule_for(cfg: AgentConfig, state: StateDir, refs: inference.References) -> str:
    """The rule (a key of ``inference.RULES``) the device predicts by. Its method's, whose
    prototypes it must hold, unless its privacy mode keeps another; a closed-form
    method's head scores the classes itself."""
    rule = inference.rule_of(cfg.method)
    if not device_method(cfg.method).trains_head:
        return rule.rule
    chosen = mode_class(cfg.privacy.mechanism).stored_rule(state.snapshot.history)
    if chosen is not None:
        return chosen
    try:
        inference.check_references(cfg.method, refs)
    except inference.MissingReference as exc:
        raise PredictorError(f"{cfg.method} predicts by {rule.summary}: {exc}") from None
    return rule.rule


def outputs_for(cfg: AgentConfig, state: StateDir, *, feature_dim: int) -> Outputs:
    """The model the state folder keeps for a bundle of ``feature_dim`` features."""
    method = device_method(cfg.method)
    if not method.trains_head:
        try:
            stored = StoredHead.load(cfg.state_dir / ClosedFormDevice.FILE, fleet=cfg.fleet,
                                     feature_dim=feature_dim, settings=cfg.closed_form,
                                     num_classes=len(cfg.classes))  # fmt: skip
        except ValueError as exc:  # a [closed_form] basis naming no basis of this size
            raise PredictorError(str(exc)) from None
        if stored is None:
            raise PredictorError(
                f"the closed-form head in {cfg.state_dir} does not fit this bundle or basis"
            )
        # A closed-form head: its scores are the logits.
        return lambda features: inference.Outputs(z=features, logits=stored.scores(features))
    model = LocalModel(in_dim=feature_dim, num_classes=len(cfg.classes), cfg=cfg.train,
                       dual=method.dual)  # fmt: skip
    if not state.load_model(model):
        raise PredictorError(f"no head checkpoint in {cfg.state_dir} that fits this bundle")
    return lambda features: inference.outputs_of(model, features)
