"""How a comparison sets up its methods: the fair protocol (the default) or the paper's.

Both give every method the same head architecture, optimiser, local epochs, data and
evaluation, and each method its paper's inference rule (edge_agent.inference); they differ
in the classifier of the methods that have one (all but FedPCL):

- ``fair``: a plain linear classifier (the agents' default), the strongest reasonable
  setting on these frozen features;
- ``paper``: the classifier of FedPCL's released code, whose outputs pass through ReLU and
  L2 normalisation before the softmax (every logit in [0, 1]): what FedPCL's published
  Solo and FedAvg figures were measured with. Applied to every method with a classifier,
  never to some baselines alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_agent.methods import DEVICE_METHODS


@dataclass(frozen=True)
class Protocol:
    name: str
    #: [train] settings of every method that has a classifier.
    classifier_train: dict[str, Any]
    #: One line for a report's first line and for --help.
    summary: str


PROTOCOLS: dict[str, Protocol] = {
    "fair": Protocol(
        "fair",
        {},
        "fair protocol: every method with a classifier has a plain linear one; the same "
        "head, optimiser, local epochs, data and evaluation for all",
    ),
    "paper": Protocol(
        "paper",
        {"classifier": "bounded"},
        "paper protocol: every method with a classifier has the bounded classifier of "
        "FedPCL's released code (ReLU and L2 normalisation on the logits); the same head, "
        "optimiser, local epochs, data and evaluation for all",
    ),
}


def protocol_train(protocol: str, method: str) -> dict[str, Any]:
    """The [train] settings ``protocol`` gives ``method`` beyond the agents' defaults."""
    try:
        chosen = PROTOCOLS[protocol]
    except KeyError:
        raise ValueError(
            f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}"
        ) from None
    # ``method`` may be the pooled-data head (fleet/report/central.py), which trains as the floor.
    free = method in DEVICE_METHODS and DEVICE_METHODS[method].classifier_free
    return {} if free else dict(chosen.classifier_train)
