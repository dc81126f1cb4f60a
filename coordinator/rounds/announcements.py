"""What the coordinator sends: every message signed for this run, and each round's
announcement built from the strategy's aggregate in the fleet's announced dtype, within
the downlink budget (coordinator.downlink) and never larger than the devices accept."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from coordinator import downlink
from coordinator.config import CoordinatorConfig
from coordinator.keys import CoordinatorKeys
from coordinator.strategies import Aggregate
from protocol import RoundAnnouncement
from protocol.auth import Signer, sign
from protocol.methods import BIAS, wire_method
from protocol.weights import averaged_weight_shapes

log = logging.getLogger(__name__)

M = TypeVar("M")


class Announcer:
    """Signs for run ``run_id`` (begun at ``run_started``, Unix seconds) with the
    coordinator's key (or not at all, when the fleet runs insecure) and builds the
    announcement that opens a round."""

    def __init__(
        self, *, config: CoordinatorConfig, keys: CoordinatorKeys, run_id: str,
        run_started: float,
    ) -> None:  # fmt: skip
        self.config = config
        self.keys = keys
        self.run_id = run_id
        self.run_started = run_started
        self._said_too_small = False
        self._dtype: type[np.floating[Any]] = (
            np.float16 if config.model.announce_dtype == "f2" else np.float32
        )

    def sign(self, message: M) -> M:
        """``message`` signed by the coordinator for this run (as is, when insecure)."""
        unsigned = dataclasses.replace(message, auth=None)  # type: ignore[type-var]
        if self.keys.signer is None:
            return unsigned
        return sign(unsigned, self.keys.signer, run=self.run_id)

    def announce(
        self, round_: int, result: Aggregate, *, deadline: float, final: bool = False
    ) -> RoundAnnouncement:
        """The signed announcement of round ``round_``, carrying ``result``.

        Raises :class:`~coordinator.downlink.AnnouncementRefused` when it would exceed the
        devices' payload limit.
        """
        model = self.config.model
        cast = self._dtype
        if wire_method(model.method).closed_form:
            result = within_dtype(result, cast)
        # (0, dim) before any aggregate, as every 2-D array of an announcement has dim columns.
        protos = np.asarray(result.global_prototypes, dtype=cast).reshape(
            len(result.global_classes), model.dim
        )
        message = RoundAnnouncement(
            fleet=self.config.fleet,
            round=round_,
            run=self.run_id,
            run_started=self.run_started,
            bundle=model.bundle,
            method=model.method,
            classes=model.classes,
            dim=model.dim,
            deadline=deadline,
            params={**model.params, **self.config.protocol.params(), "final": final},
            global_classes=result.global_classes,
            global_prototypes=protos,
            local_sets={c: np.asarray(a, dtype=cast) for c, a in result.local_sets.items()},
            client_globals={c: np.asarray(a, dtype=cast) for c, a in result.client_globals.items()},
            extras={n: np.asarray(a, dtype=np.float32) for n, a in result.extras.items()},
            wire_version=self.config.protocol.announce_version,
        )
        if message.local_sets and model.downlink_budget > 0:
            message = self._within_budget(message, model.downlink_budget)
        signed = self.sign(message)
        self._refuse_oversize(signed)
        return signed

    def _within_budget(self, message: RoundAnnouncement, budget: int) -> RoundAnnouncement:
        """``message`` with a uniform sample of its local sets, the most that keep it within
        ``budget`` bytes but at least ``downlink.MIN_SETS``; ``message`` itself when all of
        them fit."""
        sets = message.local_sets
        # Sizes measured with the encoder and the signature, so the bound is the real one.
        rest = len(self.sign(dataclasses.replace(message, local_sets={})).to_wire())
        first = min(sets)
        one = len(
            self.sign(dataclasses.replace(message, local_sets={first: sets[first]})).to_wire()
        )
        array_bytes = one - rest - downlink.key_bytes(first)
        k = downlink.sets_that_fit(
            budget=budget, rest=rest, array_bytes=array_bytes, clients=list(sets)
        )
        sent = min(max(k, downlink.MIN_SETS), len(sets))
        if sent > k and not self._said_too_small:
            # Prototypes wider than the budget was set for (dp-features sends backbone
            # features: 36 kB a set at 896-d float32): the floor still keeps Eq. 7's
            # expectation, and the size stays independent of the fleet's. Said only when
            # the floor sends more than the budget holds (k counts every set at the
            # longest client id, so any k of them fit).
            self._said_too_small = True
            log.warning(
                "model.downlink_budget = %d bytes holds only %d of the %d local sets beside "
                "the rest of the announcement (%d bytes with one); sending %d a round, above "
                "the budget: an announcement always carries at least %d, or every set of a "
                "smaller fleet",
                budget,
                k,
                len(sets),
                one,
                sent,
                downlink.MIN_SETS,
            )
        k = max(k, downlink.MIN_SETS)
        if k >= len(sets):
            return message
        chosen = downlink.sample_clients(
            list(sets), k, seed=downlink.round_seed(message.fleet, message.round)
        )
        return dataclasses.replace(message, local_sets={c: sets[c] for c in chosen})

    def _refuse_oversize(self, message: RoundAnnouncement) -> None:
        limit = self.config.agents.max_payload_bytes
        size = len(message.to_wire())
        if size > limit:
            raise downlink.AnnouncementRefused(
                round_=message.round,
                size=size,
                limit=limit,
                setting="agents.max_payload_bytes",
                remedy=(
                    "every device would drop it and the fleet would stall. FedPCL's local "
                    "sets keep to model.downlink_budget (now "
                    f"{self.config.model.downlink_budget}; 0 sends them all), "
                    'model.announce_dtype = "f2" halves every prototype; or raise the '
                    "devices' mqtt.max_payload_bytes and this setting together"
                ),
            )


def within_dtype(result: Aggregate, dtype: type[np.floating[Any]]) -> Aggregate:
    """A closed-form head (weight rows and :data:`~protocol.methods.BIAS`) scaled down
    whole, by ``M / max |v|``, when a value exceeds ``M``, the largest finite value of the
    announce dtype (65,504 for float16, about 3.4e38 for float32): it must travel finite.
    A scaled head predicts the same classes (the argmax of ``x W^T + b`` is that of
    ``s x W^T + s b``, s > 0), but its scores are scaled too, so nothing else is: a float32
    head arrives as solved (docs/protocol.md, "The closed-form head")."""
    largest_finite = float(np.finfo(dtype).max)
    bias = result.extras.get(BIAS)
    values = [np.asarray(result.global_prototypes).ravel()]
    if bias is not None:
        values.append(np.asarray(bias).ravel())
    largest = float(np.abs(np.concatenate(values)).max(initial=0.0))
    if largest <= largest_finite:
        return result
    scale = largest_finite / largest
    extras = dict(result.extras)
    if bias is not None:
        extras[BIAS] = np.asarray(bias, dtype=np.float64) * scale
    protos = np.asarray(result.global_prototypes, dtype=np.float64) * scale
    return dataclasses.replace(result, global_prototypes=protos, extras=extras)


def largest_announcement(
    config: CoordinatorConfig, clients: Sequence[str], *, signer: Signer | None
) -> RoundAnnouncement:
    """The largest announcement this coordinator would send to a fleet of ``clients``, built
    through :meth:`Announcer.announce` before any round runs: every class's global row and
    what the method sends besides in a round where every client answered (FedPCL's local
    sets, within the downlink budget; FedDBP's per-client global sets; FedAvg's and FPL's
    averaged weights, though not FPL's clusters, whose number the data decides). Arrays
    travel as raw bytes, so zeros have the size of any values. Raises
    :class:`~coordinator.downlink.AnnouncementRefused`, as that round would, when it is
    above ``agents.max_payload_bytes``: the size follows from the clients, classes, dim
    and dtype, so a fleet need not train a round to learn it."""
    model = config.model
    record = wire_method(model.method)
    rows = np.zeros((len(model.classes), model.dim))
    per_client = {client: rows for client in clients}
    weights = (
        averaged_weight_shapes(
            feature_dim=model.feature_dim, out_dim=model.dim, num_classes=len(model.classes),
            norm=model.norm,
        )
        if record.averaged
        else {}
    )  # fmt: skip
    aggregate = Aggregate(
        global_classes=tuple(range(len(model.classes))),
        global_prototypes=rows,
        # A round owner over workers sends none: they do not sum ([workers] local_sets).
        local_sets=per_client if record.local_sets and not config.workers.enabled else {},
        # FedDBP's Fisher scores make each client's global set its own.
        client_globals=per_client if record.extras == "fisher" else {},
        extras={name: np.zeros(shape, np.float32) for name, shape in weights.items()},
    )
    # A run id as long as the store's (secrets.token_hex(8)): the signature covers it.
    announcer = Announcer(
        config=config, keys=CoordinatorKeys(signer=signer), run_id="0" * 16, run_started=0.0
    )
    # A plan, not a round: a budget too small for the sets is said by the coordinator's
    # own announcer when its rounds run, not here ahead of a command's one-line refusal.
    announcer._said_too_small = True
    return announcer.announce(1, aggregate, deadline=0.0)
