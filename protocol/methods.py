"""The federated methods as the wire sees them: one record per method, saying what its
updates and announcements carry beside the prototype fields every message has.

A method is named in an update's and an announcement's ``method`` field; everything a
receiver infers from that name is here, so no other module compares a method name as a
literal. The device's side of each method (its loss, inference rule, privacy modes) is
``edge_agent/methods.py``; the coordinator's is its strategy (``coordinator/strategies/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: What an update carries in ``extras`` beside its prototype rows:
#: ``weights``: the head and classifier weights (:mod:`protocol.weights` names them);
#: ``fisher``: one array ``"fisher"`` shaped as the update's prototypes (FedDBP, Eq. 8);
#: ``statistics``: the sums a closed-form head is solved from (``"gram"``, the upper
#: triangle of the sum of ``x x^T``, for the methods that use one); ``none``: nothing.
UpdateExtras = Literal["none", "weights", "fisher", "statistics"]

#: A closed-form update's extras: the upper triangle of its second moment (1-D), and its
#: counts as they were drawn (signed under noise; the ``counts`` field holds them clamped
#: at 0, as every update's must be). An announcement's ``bias``: the solved head's biases.
GRAM = "gram"
COUNTS = "counts"
BIAS = "bias"
#: A closed-form update's basis check, ``[D, column sums of the projection]`` (1-D, k + 1
#: values: closed_form/projection.py): statistics made in another basis are refused.
BASIS = "basis"


@dataclass(frozen=True)
class WireMethod:
    """``averaged``: the announcement brings back the sample-weighted mean of the weights
    the updates carried (the device continues from it). ``local_sets``: the announcement
    carries every client's padded local prototype set (FedPCL Eq. 7). ``closed_form``:
    the prototype rows of an update are the per-class sums of the frozen features, once
    per data version, with :data:`COUNTS` beside them, and the announcement's prototype
    rows and :data:`BIAS` are the solved linear classifier. ``gram``: such an update
    carries the summed second moment too (:data:`GRAM`).

    ``splits``: the sharded coordinator's workers can each sum their share of a round and
    the round owner merge the sums exactly (docs/scale.md): a ratio of sums (the
    strategy's ``partial_mean`` says which) or summed statistics. ``secure``: a secure
    sum (docs/privacy.md, "Secure aggregation") gives the aggregation whole: a head solved
    from summed statistics, or FedProto's per-class sum of the holders' rows over their
    count; the others need each device's own release (FedCOF its class means, FedPCL its
    local set, FPL its clusters, FedDBP its scores). ``baseline``: one of the two baselines
    every method is measured against (Solo, the floor; FedAvg, the classic federated one)."""

    name: str
    extras: UpdateExtras = "none"
    averaged: bool = False
    local_sets: bool = False
    closed_form: bool = False
    gram: bool = False
    splits: bool = False
    secure: bool = False
    baseline: bool = False
    summary: str = ""

    def __post_init__(self) -> None:
        if self.averaged != (self.extras == "weights"):
            raise ValueError(f"{self.name}: averaged methods, and only they, send weights")
        if self.closed_form != (self.extras == "statistics"):
            raise ValueError(f"{self.name}: only a closed-form method sends statistics")
        if self.gram and not self.closed_form:
            raise ValueError(f"{self.name}: a second moment belongs to a closed-form method")
        if self.closed_form and not self.splits:
            raise ValueError(f"{self.name}: summed statistics split over workers")
        if self.splits and self.averaged:
            raise ValueError(f"{self.name}: an average of every update's weights does not split")
        if self.secure and self.closed_form and not self.gram:
            raise ValueError(f"{self.name}: a secure sum solves only from the second moment")


WIRE_METHODS: dict[str, WireMethod] = {
    m.name: m
    for m in (
        WireMethod("solo", baseline=True, summary="no server step: each device trains alone (the floor)"),
        WireMethod("fedavg", extras="weights", averaged=True, baseline=True,
                   summary="sample-weighted mean of head and classifier"),
        WireMethod("fedproto", splits=True, secure=True,
                   summary="per-class mean of the holders' prototypes"),
        WireMethod("fedpcl", local_sets=True, splits=True,
                   summary="count-weighted global prototypes and every client's local set"),
        WireMethod("fpl", extras="weights", averaged=True,
                   summary="FINCH cluster prototypes, unbiased prototypes, averaged model"),
        WireMethod("feddbp", extras="fisher",
                   summary="per-client Top-K Fisher fusion of the global prototypes"),
        WireMethod("lda", extras="statistics", closed_form=True, gram=True, splits=True,
                   secure=True,
                   summary="LDA solved once from the summed class statistics"),
        WireMethod("ridge", extras="statistics", closed_form=True, gram=True, splits=True,
                   secure=True,
                   summary="ridge (Fed3R) solved once from the summed class statistics"),
        WireMethod("fedcof", extras="statistics", closed_form=True, splits=True,
                   summary="ridge on the covariances implied by class means and counts alone"),
    )
}  # fmt: skip


def wire_method(name: str) -> WireMethod:
    """The record of ``name``; a ValueError names the known methods."""
    try:
        return WIRE_METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown method {name!r}; known: {', '.join(sorted(WIRE_METHODS))}"
        ) from None
