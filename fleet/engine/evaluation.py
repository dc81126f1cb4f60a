"""What a simulated fleet scores beyond a device's own figure: every method by cosine
similarity to its local prototypes (FedPCL's rule) and by its classifier, each round, so
reports can compare the methods' inference rules on the same trained heads."""

from __future__ import annotations

from typing import Any

from edge_agent import inference as inf
from edge_agent.evaluation import Evaluator
from edge_agent.methods import device_method


class FleetEvaluator(Evaluator):
    def comparisons(
        self, out: inf.Outputs, refs: inf.References, *, rule: str | None
    ) -> dict[str, Any]:
        by_rule = inf.RULES
        return {
            "test_accuracy_prototype": self._accuracy(by_rule["local_prototype_cosine"], out, refs),
            # A method without a classifier has none to score, unless a dp-features device
            # (``rule`` given) trained one to choose between rules.
            "test_accuracy_classifier": (
                None
                if device_method(self.method).classifier_free and rule is None
                else self._accuracy(by_rule["classifier"], out, refs)
            ),
        }
