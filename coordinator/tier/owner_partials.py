"""The round owner's tally (coordinator/rounds/tally.py): the workers' partial sums.

When the round is due the tally **collects**: a :class:`~coordinator.tier.partial_wire.CollectRequest`
to every worker, asked again every ``[workers] collect_retry_s`` of whoever has not
answered (a worker's session is persistent: a stopped worker gets the request when it
comes back, and answers from its database). It waits for every named worker: a worker's
stored updates have their receipts, and closing without them would lose them. It then
**resolves** clients two workers hold (coordinator/tier/partial_wire.py::exclusions), asks those
workers again without them, merges exactly (``combine``) and divides once
(coordinator/tier/partial.py::global_prototypes). Closed-form methods (lda, ridge, fedcof): the
partials carry the summed statistics of their updates; in the same second phase the owner
asks for the earlier statistics of the clients whose new ones replace them, and solves the
head from the fleet's total with the single coordinator's strategy
(coordinator/tier/owner_statistics.py says how, and why so).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import closed_form as cf
from coordinator.config import CoordinatorConfig
from coordinator.rounds.head_guard import guarded
from coordinator.rounds.open_round import OpenRound
from coordinator.rounds.tally import Tallied, Tally
from coordinator.strategies import Aggregate
from coordinator.tier.owner_collect import Collect, plan
from coordinator.tier.owner_statistics import Close, OwnerStatistics
from coordinator.tier.partial import Mean, PartialSum, global_prototypes
from coordinator.tier.partial_wire import CollectRequest, combine
from coordinator.tier.worker_ledger import Answer, WorkerLedger, WorkerMetrics
from protocol import RoundAnnouncement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Closed:
    """What the owner made of a round: the merged partial sum, the float64 global
    prototypes (C, d) and mask, before the announcement's cast to ``announce_dtype``, and
    the aggregate announced (for a closed-form method, its head, whose weight rows are
    ``values[has]``; ``statistics`` is then the fleet's total it was solved from)."""

    round: int
    merged: PartialSum
    values: np.ndarray
    has: np.ndarray
    result: Aggregate = field(default_factory=Aggregate)
    statistics: cf.Statistics | None = None


@dataclass(frozen=True)
class _Close:
    """What :meth:`WorkerPartials.committed` needs back of a close."""

    closed: Closed
    shares: Sequence[Answer]
    solved: Close | None


class WorkerPartials(Tally):
    """The round's result from the workers' partial sums (module text)."""

    def __init__(
        self,
        *,
        config: CoordinatorConfig,
        run_id: str,
        mean: Mean | None,
        statistics: OwnerStatistics | None,
        ledger: WorkerLedger,
        worker_metrics: WorkerMetrics | None,
        count_unknown: bool,
    ) -> None:
        self.config, self.run_id = config, run_id
        self.members = config.workers.members
        self.mean, self.statistics = mean, statistics
        self.ledger, self.worker_metrics = ledger, worker_metrics
        #: The receipts sent before this start are not heard again: the count is unknown.
        self.count_unknown = count_unknown
        self.collect: Collect | None = None
        self.closed: Closed | None = None

    def wait_s(self, now: float) -> float | None:
        if self.collect is None:
            return None
        return self.collect.asked_at + self.config.workers.collect_retry_s - now

    def tally(
        self, closing: OpenRound, *, now: float, last: RoundAnnouncement
    ) -> Tallied | list[Any]:
        if self.collect is None:
            self.collect = Collect(round=closing.number, started=now)
            log.info(
                "round %d: collecting from %d worker(s); %d client(s) receipted",
                closing.number, len(self.members), len(closing.digests),
                extra={"event": "collect", "round": closing.number},
            )  # fmt: skip
        collect = self.collect
        waiting = collect.waiting(self.members)
        if not waiting:
            asks = plan(collect, members=self.members, statistics=self.statistics)
            if collect.asks is None or asks != collect.asks:
                changed = collect.ask(asks)
                if changed:
                    log.info(
                        "round %d: asking %s again: %d client(s) left out (held by another "
                        "worker), %d client(s)' earlier statistics taken back", collect.round,
                        ", ".join(changed), sum(len(a.exclude) for a in asks.values()),
                        sum(len(a.retract) for a in asks.values()),
                    )  # fmt: skip
                waiting = collect.waiting(self.members)
        if not waiting:
            return self._merge(closing, last)
        return self._ask(waiting, now)

    def _ask(self, waiting: list[str], now: float) -> list[CollectRequest]:
        collect = self.collect
        assert collect is not None
        if now < collect.asked_at + self.config.workers.collect_retry_s:
            return []
        if collect.asked_at > -np.inf:
            log.warning(
                "round %d: no answer from worker(s) %s for %.0f s; asking again (the round "
                "waits for every worker: their stored updates have receipts)",
                collect.round, ", ".join(waiting), now - collect.started,
                extra={"event": "worker_unanswered", "round": collect.round},
            )  # fmt: skip
        if self.worker_metrics is not None:
            for worker in waiting:
                self.worker_metrics.unanswered.labels(worker=worker).set(now - collect.started)
        collect.asked_at = now
        fleet = self.config.fleet
        if collect.asks is None and len(waiting) == len(self.members):
            return [CollectRequest(fleet=fleet, run=self.run_id, round=collect.round)]
        return [collect.request(fleet, self.run_id, worker) for worker in waiting]

    def _merge(self, closing: OpenRound, last: RoundAnnouncement) -> Tallied:
        collect = self.collect
        assert collect is not None and collect.asks is not None
        answers = {**collect.first, **collect.final}
        merged = combine(answers.values(), fleet=self.config.fleet, run=self.run_id,
                         round_=closing.number)  # fmt: skip
        solved, kept = None, ""
        if self.statistics is not None:
            # Counted whatever rounds.floor says: the devices sent them once, have their
            # receipts and will not send them again.
            solved = self.statistics.solve(answers, round_=closing.number)
            result, kept = guarded(solved.result, last)
            values, has = _dense(result, self.config)
        else:
            assert self.mean is not None
            values, has = global_prototypes(merged, mean=self.mean)
            result = self._globals(values, has, merged, closing.number, last)
        closed = Closed(
            round=closing.number, merged=merged, values=values, has=has, result=result,
            statistics=None if solved is None else solved.total,
        )  # fmt: skip
        shares = [
            Answer(worker=w, held=len(collect.first[w].partial.clients),
                   counted=len(answers[w].partial.clients), answered_at=collect.answered_at[w])
            for w in self.members
        ]  # fmt: skip
        source = (
            f"{len(self.members)} worker(s) ("
            + ", ".join(f"{s.worker} {s.counted}" for s in shares)
            + ")"
        )
        return Tallied(
            result, updates=len(merged.clients), source=source,
            detail=_Close(closed=closed, shares=shares, solved=solved), kept=kept,
        )  # fmt: skip

    def _globals(
        self, values: np.ndarray, has: np.ndarray, merged: PartialSum, round_: int,
        last: RoundAnnouncement,
    ) -> Aggregate:  # fmt: skip
        """The global prototypes to announce: the merged partials', or, below
        ``rounds.floor`` (only after a restart lost the count), the last global state."""
        floor = self.config.rounds.floor
        if len(merged.clients) >= floor:
            return Aggregate(
                global_classes=tuple(int(c) for c in np.flatnonzero(has)),
                global_prototypes=values[has],
            )
        log.warning(
            "round %d: collected %d update(s), below rounds.floor = %d; opening round %d "
            "with the last global state", round_, len(merged.clients), floor, round_ + 1,
        )  # fmt: skip
        return Aggregate(
            global_classes=last.global_classes,
            global_prototypes=np.asarray(last.global_prototypes, dtype=np.float64),
        )

    def before_commit(self, tallied: Tallied) -> None:
        close: _Close = tallied.detail
        if self.statistics is not None and close.solved is not None:
            self.statistics.save(close.solved)  # before the close commits: see its docstring

    def committed(self, tallied: Tallied | None) -> None:
        self.collect = None
        self.count_unknown = False
        if tallied is None:
            return
        close: _Close = tallied.detail
        self.closed = close.closed
        if self.statistics is not None and close.solved is not None:
            self.statistics.committed(close.solved)
        self.ledger.record(
            close.closed.round, close.shares, keep_rounds=self.config.rounds.keep_rounds
        )
        if self.worker_metrics is not None:
            for share in close.shares:
                self.worker_metrics.held.labels(worker=share.worker).set(share.held)


def _dense(result: Aggregate, config: CoordinatorConfig) -> tuple[np.ndarray, np.ndarray]:
    """An announced head's weight rows in the dense (C, d) layout, and its class mask."""
    values = np.zeros((len(config.model.classes), config.model.dim))
    has = np.zeros(len(config.model.classes), dtype=bool)
    classes = list(result.global_classes)
    values[classes] = result.global_prototypes
    has[classes] = True
    return values, has
