"""The round owner of a sharded coordinator (docs/scale.md): the rounds over the worker
tier, transport-free (coordinator/service/owner_service.py carries its messages over MQTT; the
workers' shares are kept by coordinator/tier/worker_ledger.py).

The workers (coordinator/tier/worker.py) take in the updates; the owner holds the fleet's rounds
in the coordinator's own database (coordinator/storage/store.py: rounds, announcements, run id; no
updates) and does the rest of what coordinator/rounds/manager.py does for a single coordinator:

- **Announces** round r, signed (coordinator/rounds/announcements.py), retained on the round topic
  the devices and the workers read.
- **Counts** the round's updates from the receipts the workers send the devices: a receipt
  is signed with the coordinator's key after the worker committed the update, so the
  distinct clients named by the round's receipts are a count of the stored updates that
  costs no message of its own. (A collect request cannot serve as a count: a worker that
  answers one takes no more updates of the round.) Quorum, ``wait_after_quorum_s``,
  deadline, extensions and floor are then the single coordinator's rules
  (coordinator/rounds/open_round.py).
- **Collects** when the round is due, resolves clients two workers hold, merges exactly
  and solves: its tally, coordinator/tier/owner_partials.py. The round's life (the clock, the
  close transaction with the announcement of round r+1, resume and run identity, the
  devices' statuses) is the single coordinator's cycle (coordinator/rounds/cycle.py).

Only methods whose record ``splits`` (a ratio of sums, or a sum of statistics)
run here; the ratios with the rows and counts as sent (``RAW``: a worker's partial cannot
apply a median defence). Anything else is refused at start with one line
(:func:`refusal`).

A restarted owner has lost the open round's receipt count: it collects at the round's
deadline at the latest, whatever its count, and the merged partials decide; below
``rounds.floor`` it opens the next round with the last global state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeAlias

from coordinator.config import CoordinatorConfig
from coordinator.metrics import Metrics
from coordinator.rounds.cycle import RoundCycle
from coordinator.rounds.tally import Tally
from coordinator.storage.store import RoundRow, Store
from coordinator.strategies import make_strategy
from coordinator.strategies.base import RAW
from coordinator.strategies.closed_form import ClosedForm
from coordinator.tier.owner_partials import Closed, WorkerPartials
from coordinator.tier.owner_statistics import OwnerStatistics
from coordinator.tier.partial import Mean
from coordinator.tier.partial_wire import CollectRequest, PartialMessage
from coordinator.tier.worker_ledger import WorkerLedger, WorkerMetrics
from protocol import ProtocolError, RoundAnnouncement
from protocol.auth import signature_problem
from protocol.methods import WIRE_METHODS, wire_method
from protocol.receipts import Receipt

log = logging.getLogger(__name__)

#: The robust options whose work a partial sum can hold: none. RAW's fields, named.
_MEDIANS = ("median_count_cap", "median_norm_clip", "median_direction_screen")


def refusal(cfg: CoordinatorConfig) -> str | None:
    """Why ``cfg`` cannot run over workers, in one line naming the setting; None if it can."""
    method = cfg.model.method
    record = wire_method(method)
    if record.closed_form:
        # Its statistics are sums (coordinator/tier/owner_statistics.py): the per-client cap
        # needs every client's statistics, which no worker sends. Said, not switched off
        # quietly: the default is the safe one.
        if cfg.closed_form.count_cap:
            return (
                f"[workers]: closed_form.count_cap = {cfg.closed_form.count_cap} caps each "
                "client's statistics, which only the single coordinator keeps; set "
                "count_cap = 0 to run over workers (admission still bounds each device), or "
                "leave [workers] out"
            )
        return None
    if not record.splits:
        if record.averaged:
            why = "its announcement averages the weights every update carries"
        elif record.extras != "none":
            why = "its aggregation is per client"
        else:
            why = "it has no server step to split"
        return (
            f"[workers]: model.method = {method!r} does not run over workers ({why}); "
            f"supported: {', '.join(_supported())}. Leave [workers] out to run the single "
            "coordinator"
        )
    if wire_method(method).local_sets and cfg.workers.local_sets != "omit":
        return (
            f"[workers]: model.method = {method!r} announces every client's local set (Eq. 7), "
            'which partial sums do not carry; set [workers] local_sets = "omit" to announce '
            "the global prototypes only (the devices' local term is then 0), or leave "
            "[workers] out"
        )
    robust = cfg.robust
    if robust.rule != "mean":
        return (
            f"[workers]: robust.rule = {robust.rule!r} needs every update of a round at once; "
            'use rule = "mean" or leave [workers] out'
        )
    on = [name for name in _MEDIANS if getattr(robust, name)]
    if on:
        return (
            f"[workers]: robust.{', robust.'.join(on)} need every update of a round at once, "
            "which no worker holds; set them to false in [robust] to run over workers "
            "(docs/scale.md) or leave [workers] out"
        )
    if robust.count_cap is not None or robust.norm_bound is not None:
        return (
            "[workers]: robust.count_cap and robust.norm_bound are not applied by the workers "
            "(not built); leave them out of [robust] or leave [workers] out"
        )
    assert dataclasses.replace(robust, trim=RAW.trim) == RAW  # what a partial sum holds
    return None


def _supported() -> list[str]:
    return sorted(m.name for m in WIRE_METHODS.values() if m.splits)


Outgoing: TypeAlias = RoundAnnouncement | CollectRequest

__all__ = ["Closed", "Outgoing", "RoundOwner", "refusal"]


class RoundOwner(RoundCycle):
    """Transport-free: :meth:`hear_receipt`, :meth:`take_partial` and ``record_status``
    take what the broker brings (on its thread), :meth:`poll` says what to send.
    Thread-safe."""

    def __init__(
        self,
        *,
        config: CoordinatorConfig,
        store: Store,
        metrics: Metrics | None = None,
        worker_metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        problem = refusal(config)
        if problem is not None:
            raise ValueError(problem)
        self.members = config.workers.members
        self.worker_metrics = worker_metrics
        #: Partials refused before they were looked at, by reason (``malformed``: not a
        #: partial this code decodes; ``wrong_shape``: of other classes, dimensions or
        #: statistics than the fleet's).
        self.refused: Counter[str] = Counter()
        self.ledger = WorkerLedger(store.path)
        super().__init__(config=config, store=store, metrics=metrics, clock=clock)

    def _make_tally(self, latest: RoundRow, *, resumed: bool) -> Tally:
        config = self.config
        record = wire_method(config.model.method)
        statistics: OwnerStatistics | None = None
        mean: Mean | None = None
        if record.closed_form:
            # The fleet's statistics and the head they solve, kept beside the rounds in the
            # coordinator's database (coordinator/tier/owner_statistics.py).
            strategy = make_strategy(
                record.name, robust=config.robust, **dict(config.model.strategy)
            )
            assert isinstance(strategy, ClosedForm)  # the method's record says it is
            statistics = OwnerStatistics(
                path=self.store.path, strategy=strategy, num_classes=len(config.model.classes),
                dim=config.model.dim, gram=record.gram, open_round=latest.round,
                synchronous=config.sqlite_synchronous,
            )  # fmt: skip
        else:
            # How the merged sums divide: the strategy's, FedPCL's by its weighting.
            mean = make_strategy(
                record.name, robust=config.robust, **dict(config.model.strategy)
            ).partial_mean
            assert mean is not None  # the method's record says it splits
        self.partials = WorkerPartials(
            config=config, run_id=self.run_id, mean=mean, statistics=statistics,
            ledger=self.ledger, worker_metrics=self.worker_metrics, count_unknown=resumed,
        )  # fmt: skip
        return self.partials

    def close(self) -> None:
        self.ledger.close()
        if self.partials.statistics is not None:
            self.partials.statistics.close()

    @property
    def closed(self) -> Closed | None:
        """What the owner made of the round it closed last (None before one)."""
        return self.partials.closed

    @property
    def counted(self) -> int:
        """Clients the open round's receipts named so far."""
        with self._lock:
            return len(self._open.digests)

    # -- what the broker brings ----------------------------------------------------------

    def hear_receipt(self, payload: bytes | bytearray) -> bool:
        """Count the client a worker's receipt names, if it is the coordinator's for the
        open round of this run; whether it is a client not counted before."""
        try:
            receipt = Receipt.from_wire(payload)
        except ProtocolError:
            return False
        if receipt.fleet != self.config.fleet or receipt.run != self.run_id:
            return False
        if not self.keys.insecure:
            signer = None if self.keys.signer is None else self.keys.signer.public
            if signature_problem(receipt, signer, run=self.run_id) is not None:
                return False
        with self._lock:
            open_ = self._open
            if self.partials.collect is not None or receipt.round != open_.number:
                return False
            if receipt.client in open_.digests:
                return False
            open_.digests[receipt.client] = receipt.digest
            open_.arrivals.append(self._clock())
            self.presence.know(receipt.client)
        return True

    def take_partial(self, payload: bytes | bytearray) -> bool:
        """Keep a worker's answer to the open collect; whether it was one. A partial that
        does not decode, or not to the fleet's shapes, is refused and counted."""
        try:
            message = PartialMessage.from_wire(payload)
        except ProtocolError as exc:
            log.warning("a malformed partial sum (%s): ignored", exc)
            self._refuse("malformed")
            return False
        problem = self._shape_problem(message)
        if problem is not None:
            log.warning("a partial sum from %s %s: ignored", message.worker, problem)
            self._refuse("wrong_shape")
            return False
        with self._lock:
            collect = self.partials.collect
            if (
                collect is None
                or (message.fleet, message.run, message.round)
                != (self.config.fleet, self.run_id, collect.round)
                or message.worker not in self.members
            ):
                return False
            now = self._clock()
            if collect.asks is None and not message.excluded and not message.retract:
                collect.first.setdefault(message.worker, message)
            elif collect.asks is not None and message.worker in collect.asks:
                if not collect.asks[message.worker].answered_by(message):
                    return False
                collect.final.setdefault(message.worker, message)
            else:
                return False
            collect.answered_at[message.worker] = now
            if self.worker_metrics is not None:
                self.worker_metrics.answered.labels(worker=message.worker).set(now)
                self.worker_metrics.unanswered.labels(worker=message.worker).set(0)
        return True

    def _shape_problem(self, message: PartialMessage) -> str | None:
        """Why ``message`` cannot be merged into this fleet's sums (a worker on another
        configuration), or None: checked here, so that the close never meets it."""
        model = self.config.model
        shape = (len(model.classes), model.dim)
        if (message.partial.num_classes, message.partial.dim) != shape:
            return (
                f"is of {message.partial.num_classes} classes x {message.partial.dim}, not {shape}"
            )
        parts = [p for p in (message.statistics, message.retraction) if p is not None]
        statistics = self.partials.statistics
        if statistics is None:
            return "carries statistics, which this fleet's method does not" if parts else None
        if message.statistics is None:
            return "carries no statistics"
        if any(p.gram != statistics.gram for p in parts):
            return "carries another method's statistics"
        return None

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1
        if self.worker_metrics is not None:
            self.worker_metrics.refused.labels(reason=reason).inc()

    # -- deciding --------------------------------------------------------------------------

    def poll(self) -> list[Outgoing]:
        """What to send now: collect requests, or the announcement of a round opened (or
        extended); nothing while nothing is due."""
        return self._turn()
