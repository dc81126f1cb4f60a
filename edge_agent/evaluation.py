"""A device's figure on its own labelled test split (``[data] test``), by its method's
inference rule (:mod:`edge_agent.inference`): what ``edge-agent status`` shows after every
round. The simulated fleet's comparisons of every rule live in fleet/engine/evaluation.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from edge_agent import data as data_mod
from edge_agent import inference as inf
from edge_agent.config import AgentConfig
from edge_agent.data import LocalData
from edge_agent.state import StateDir
from edge_agent.train import LocalModel


class Evaluator:
    @classmethod
    def for_test_split(
        cls, cfg: AgentConfig, *, load: Callable[[LocalData], np.ndarray]
    ) -> Evaluator | None:
        """The evaluator of ``cfg``'s test split (``load`` gives its features), or None
        if the configuration names none."""
        if not cfg.data.test:
            return None
        test = data_mod.load(cfg.data.test, cfg.classes, size=cfg.data.image_size)
        return cls(method=cfg.method, features=load(test), labels=test.labels)

    def __init__(self, *, method: str, features: np.ndarray, labels: np.ndarray) -> None:
        self.method = method
        self.rule = inf.rule_of(method)
        self.features = features  # (N, K*d_e) cached
        self.labels = labels

    def after_training(
        self, model: LocalModel, protos: np.ndarray, counts: np.ndarray, *, rule: str | None = None
    ) -> dict[str, Any]:
        """A round's figures once its head is trained. ``test_accuracy`` (the method's
        own rule) is None for a method predicting with the coordinator's output, which
        :meth:`from_server` fills in when it arrives. ``rule`` (a key of
        ``inference.RULES``) overrides the method's: a dp-features device predicts by the
        rule its validation split chose, and trains its classifier whatever the method."""
        out = inf.outputs_of(model, self.features)
        refs = inf.References(local=protos, local_present=counts > 0)
        return self.scores(out, refs, rule=rule)

    def scores(
        self, out: inf.Outputs, refs: inf.References, *, rule: str | None = None
    ) -> dict[str, Any]:
        """:meth:`after_training`'s figures from the outputs on the test split, already
        computed (the simulator's vector engine computes a fleet's at once)."""
        if rule is not None:
            own = self._accuracy(inf.RULES[rule], out, refs)
        else:
            own = None if self.rule.from_server else self.own(out, refs)
        return {"test_accuracy": own} | self.comparisons(out, refs, rule=rule)

    def comparisons(
        self, out: inf.Outputs, refs: inf.References, *, rule: str | None
    ) -> dict[str, Any]:
        """Figures beyond the device's own, for research: none on a device
        (fleet/engine/evaluation.py scores every method by every rule)."""
        return {}

    def from_server(self, model: LocalModel, state: StateDir) -> dict[str, Any]:
        """The method's own figure on the model and prototypes the device holds once the
        coordinator's output is adopted: exactly what ``edge-agent predict`` uses."""
        out = inf.outputs_of(model, self.features)
        return {"test_accuracy": self.own(out, inf.stored_references(state))}

    def own(self, out: inf.Outputs, refs: inf.References) -> float | None:
        """The method's own figure, by the rule ``edge-agent predict`` uses."""
        # inference.predict: the very function `edge-agent predict` calls.
        return self._accuracy(lambda o, r: inf.predict(self.method, o, r), out, refs)

    def _accuracy(self, rule: inf.Rule, out: inf.Outputs, refs: inf.References) -> float | None:
        try:
            return inf.accuracy(rule(out, refs), self.labels)
        except inf.MissingReference:
            return None  # FedDBP's round 0 before any global prototype, for instance
