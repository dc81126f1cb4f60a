"""The federated methods as a device sees them: one record per method, every device fact
about it in one place (how it predicts, the shape of its model, which privacy modes
apply). What its messages carry is its wire record (``protocol/methods.py``); its local
objective is ``edge_agent.train.LOSSES[name]``, its server side a registered strategy.

No module outside the two record files compares a method's name as a literal
(tests/test_methods.py reads the tree for it): a fact about a method is a field here.
Adding a method: a record here and in ``protocol/methods.py``, its objective, its
strategy. Kept free of torch, so reading a configuration does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocol.methods import WIRE_METHODS, WireMethod

#: The baseline with no federation: the floor every federated method is measured against
#: (and the objective a pooled-data head trains with).
FLOOR = "solo"
#: The project's core method (FedPCL): the default of a run, the one a report details.
CORE = "fedpcl"


@dataclass(frozen=True)
class MethodRule:
    """How a method predicts: ``rule`` (a key of ``edge_agent.inference.RULES``); the
    prototypes it compares against, if any; and whether it predicts with what the
    coordinator returns for a round (the averaged model, the global prototypes). Such a
    score belongs to the round whose updates built it, and is known when the next
    announcement (or the final one) arrives."""

    rule: str
    prototypes: Literal["local", "global"] | None
    from_server: bool
    summary: str  # for reports


@dataclass(frozen=True)
class DeviceMethod:
    """``dual``: FedDBP's shared and decision branches. ``classifier_free``: the objective
    never trains the classifier (FedPCL Table 4: the projection head alone), so a
    classifier figure or setting does not apply. ``anchor``: the term through which the
    global class means of a feature-space release (``dp-features``) reach the head:
    FedPCL's contrast or FedProto's distance. ``modes``: the ``[privacy] mechanism``
    values that apply (``dp`` needs DP-SGD through the method's model; ``dp-features``
    a release its global knowledge can be built from). ``dp_warmup``: under DP-SGD the method trains
    cross-entropy alone until global prototypes arrive (FPL: its per-sample loss needs
    them)."""

    name: str
    rule: MethodRule
    dual: bool = False
    classifier_free: bool = False
    anchor: Literal["contrast", "distance"] | None = None
    modes: frozenset[str] = frozenset({"none", "paper", "dp"})
    dp_warmup: bool = False
    wire: WireMethod = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire", WIRE_METHODS[self.name])

    @property
    def trains_head(self) -> bool:
        """The device trains a projection head with an objective of
        ``edge_agent.train.LOSSES``; a closed-form method's solves a linear head instead."""
        return not self.wire.closed_form


_SERVER_MODEL = MethodRule("classifier", None, True, "the round's global model")
_FEATURE_MODES = frozenset({"none", "paper", "dp", "dp-features"})
# A closed-form device predicts with a linear head on its (projected) features, chosen on
# its validation split (edge_agent/closed_form.py); its release is its statistics.
_CLOSED_FORM = MethodRule(
    "classifier", None, True,
    "its closed-form linear head (the fleet's, personalised or its own, chosen on its "
    "validation split)",
)  # fmt: skip
_STATISTICS_MODES = frozenset({"none", "dp-features"})

DEVICE_METHODS: dict[str, DeviceMethod] = {
    m.name: m
    for m in (
        DeviceMethod(FLOOR, MethodRule("classifier", None, False, "its classifier")),
        DeviceMethod("fedavg", _SERVER_MODEL),
        DeviceMethod(
            "fedproto",
            MethodRule("global_prototype_distance", "global", True,
                       "Euclidean distance to the global prototypes"),
            anchor="distance",
            modes=_FEATURE_MODES,
        ),
        DeviceMethod(
            CORE,
            MethodRule("local_prototype_cosine", "local", False,
                       "cosine similarity to its local prototypes"),
            classifier_free=True,
            anchor="contrast",
            modes=_FEATURE_MODES,
        ),
        DeviceMethod("fpl", _SERVER_MODEL, dp_warmup=True),
        DeviceMethod(
            "feddbp",
            MethodRule("decision_global_distance", "global", True,
                       "its decision branch's distance to its personalised global prototypes"),
            dual=True,
            modes=frozenset({"none", "paper"}),  # DP-SGD: its dual branch shares a classifier
        ),
        *(
            DeviceMethod(name, _CLOSED_FORM, modes=_STATISTICS_MODES)
            for name in ("lda", "ridge", "fedcof")
        ),
    )
}  # fmt: skip

#: The methods an agent runs, in the order reports list them.
METHODS = tuple(DEVICE_METHODS)


def device_method(name: str) -> DeviceMethod:
    """The record of ``name``; a ValueError names the methods an agent runs."""
    try:
        return DEVICE_METHODS[name]
    except KeyError:
        raise ValueError(
            f"method {name!r} is not supported on the agent; use one of "
            f"{', '.join(sorted(DEVICE_METHODS))}"
        ) from None
