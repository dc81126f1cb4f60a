"""The round owner of a sharded coordinator (docs/scale.md): the rounds over the worker
tier, transport-free (coordinator/owner_service.py carries its messages over MQTT; the
workers' shares are kept by coordinator/worker_ledger.py).

The workers (coordinator/worker.py) take in the updates; the owner holds the fleet's rounds
in the coordinator's own database (coordinator/store.py: rounds, announcements, run id; no
updates) and does the rest of what coordinator/rounds.py does for a single coordinator:

- **Announces** round r, signed (coordinator/announcements.py), retained on the round topic
  the devices and the workers read.
- **Counts** the round's updates from the receipts the workers send the devices: a receipt
  is signed with the coordinator's key after the worker committed the update, so the
  distinct clients named by the round's receipts are a count of the stored updates that
  costs no message of its own. (A collect request cannot serve as a count: a worker that
  answers one takes no more updates of the round.) Quorum, ``wait_after_quorum_s``,
  deadline, extensions and floor are then the single coordinator's rules
  (coordinator/open_round.py).
- **Collects** when the round is due: a :class:`~coordinator.partial_wire.CollectRequest`
  to every worker, asked again every ``[workers] collect_retry_s`` of whoever has not
  answered (a worker's session is persistent: a stopped worker gets the request when it
  comes back, and answers from its database). The owner waits for every named worker: a
  worker's stored updates have their receipts, and closing without them would lose them.
- **Resolves** clients two workers hold (coordinator/partial_wire.py::exclusions), asks
  those workers again without them, merges exactly (``combine``), divides once
  (coordinator/partial.py::global_prototypes) and announces round r+1 in the same
  transaction as closing r (``Store.advance``).
- **Closed-form methods** (lda, ridge, fedcof): the partials carry the summed statistics
  of their updates; in the same second phase the owner asks for the earlier statistics
  of the clients whose new ones replace them, and solves the head from the fleet's total
  with the single coordinator's strategy (coordinator/owner_statistics.py says how, and
  why so).

Only methods whose aggregation is a ratio of sums (:data:`SPLITS`) or a sum of statistics
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
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from coordinator.announcements import Announcer
from coordinator.config import CoordinatorConfig
from coordinator.keys import CoordinatorKeys
from coordinator.metrics import Metrics
from coordinator.open_round import OpenRound
from coordinator.owner_collect import Collect, plan
from coordinator.owner_statistics import OwnerStatistics
from coordinator.partial import Mean, PartialSum, global_prototypes
from coordinator.partial_wire import CollectRequest, PartialMessage, combine
from coordinator.store import Store
from coordinator.strategies import Aggregate, make_strategy
from coordinator.strategies.base import RAW
from coordinator.strategies.closed_form import ClosedForm
from coordinator.worker_ledger import Answer, WorkerLedger, WorkerMetrics
from protocol import ProtocolError, RoundAnnouncement
from protocol.auth import signature_problem
from protocol.methods import WIRE_METHODS, wire_method
from protocol.receipts import Receipt
from runtime import closed_form as cf

log = logging.getLogger(__name__)

#: How each method's global prototypes come out of the merged partial sums
#: (coordinator/partial.py::Mean): the methods whose aggregation splits. FedPCL's
#: ``weighting`` is its strategy parameter; FedProto's is the holders' plain mean.
SPLITS: dict[str, Callable[[CoordinatorConfig], Mean]] = {
    "fedpcl": lambda cfg: "paper" if cfg.model.strategy.get("weighting") == "paper" else "count",
    "fedproto": lambda cfg: "client",
}
#: The robust options whose work a partial sum can hold: none. RAW's fields, named.
_MEDIANS = ("median_count_cap", "median_norm_clip", "median_direction_screen")


def refusal(cfg: CoordinatorConfig) -> str | None:
    """Why ``cfg`` cannot run over workers, in one line naming the setting; None if it can."""
    method = cfg.model.method
    record = wire_method(method)
    if record.closed_form:
        # Its statistics are sums (coordinator/owner_statistics.py), and the configuration
        # already refuses a [robust] table for it: nothing here to refuse.
        return None
    if method not in SPLITS:
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
    return sorted({*SPLITS, *(m.name for m in WIRE_METHODS.values() if m.closed_form)})


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


Outgoing: TypeAlias = RoundAnnouncement | CollectRequest


class RoundOwner:
    """Transport-free: :meth:`hear_receipt` and :meth:`take_partial` take what the broker
    brings (on its thread), :meth:`poll` says what to send. Thread-safe."""

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
        self.config = config
        self.store = store
        self.members = config.workers.members
        self.metrics = metrics or Metrics()
        self.worker_metrics = worker_metrics
        record = wire_method(config.model.method)
        self._mean: Mean | None = None if record.closed_form else SPLITS[record.name](config)
        self._clock = clock
        self._lock = threading.RLock()
        self.keys = CoordinatorKeys.load(config.security)
        now = clock()
        self.run_id, self.run_started = store.run(now=now)
        self.announcer = Announcer(
            config=config, keys=self.keys, run_id=self.run_id, run_started=self.run_started
        )
        store.bind_identity(
            {"fleet": config.fleet, "method": config.model.method, "bundle": config.model.bundle}
        )
        latest = store.latest_round()
        resumed = latest is not None
        if latest is None:
            first = self.announcer.announce(0, Aggregate(), deadline=now + config.rounds.timeout_s)
            store.open_first_round(first.to_wire(), opened_at=now, deadline=first.deadline)
            latest = store.latest_round()
            assert latest is not None
            log.info("fleet %s: started run %s at round 0 (round owner)", config.fleet, self.run_id)
        self._announcement = self.announcer.sign(
            RoundAnnouncement.from_wire(latest.announcement, max_bytes=1 << 62)
        )
        self._done = latest.closed_at is not None
        self._open = OpenRound(
            number=latest.round, opened_at=latest.opened_at, deadline=latest.deadline,
            extensions=latest.extensions,
        )  # fmt: skip
        #: The receipts sent before this start are not heard again: the count is unknown.
        self._count_unknown = resumed
        self._collect: Collect | None = None
        self.closed: Closed | None = None
        #: Partials refused before they were looked at, by reason (``malformed``: not a
        #: partial this code decodes; ``wrong_shape``: of other classes, dimensions or
        #: statistics than the fleet's).
        self.refused: Counter[str] = Counter()
        self.ledger = WorkerLedger(store.path)
        # Closed-form methods: the fleet's statistics and the head they solve, kept beside
        # the rounds in the coordinator's database (coordinator/owner_statistics.py).
        self._statistics: OwnerStatistics | None = None
        if record.closed_form:
            strategy = make_strategy(
                record.name, robust=config.robust, **dict(config.model.strategy)
            )
            assert isinstance(strategy, ClosedForm)  # the method's record says it is
            self._statistics = OwnerStatistics(
                path=store.path, strategy=strategy, num_classes=len(config.model.classes),
                dim=config.model.dim, gram=record.gram, open_round=latest.round,
                synchronous=config.sqlite_synchronous,
            )  # fmt: skip
        self.metrics.current_round.set(self._open.number)
        self.metrics.round_opened.set(self._open.opened_at)

    def close(self) -> None:
        self.ledger.close()
        if self._statistics is not None:
            self._statistics.close()

    # -- state ---------------------------------------------------------------------------

    @property
    def round(self) -> int:
        return self._open.number

    @property
    def announcement(self) -> RoundAnnouncement:
        return self._announcement

    @property
    def done(self) -> bool:
        return self._done

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
            if self._collect is not None or receipt.round != open_.number:
                return False
            if receipt.client in open_.digests:
                return False
            open_.digests[receipt.client] = receipt.digest
            open_.arrivals.append(self._clock())
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
            collect = self._collect
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
        if self._statistics is None:
            return "carries statistics, which this fleet's method does not" if parts else None
        if message.statistics is None:
            return "carries no statistics"
        if any(p.gram != self._statistics.gram for p in parts):
            return "carries another method's statistics"
        return None

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1
        if self.worker_metrics is not None:
            self.worker_metrics.refused.labels(reason=reason).inc()

    # -- deciding --------------------------------------------------------------------------

    def seconds_until_due(self) -> float:
        """How long the driver may wait before calling :meth:`poll` again."""
        with self._lock:
            if self._done:
                return np.inf
            now = self._clock()
            if self._collect is not None:
                return max(0.0, self._collect.asked_at + self.config.workers.collect_retry_s - now)
            due = self._open.close_time(self.config.rounds)
            target = self._open.deadline if due is None else min(due, self._open.deadline)
            if target > now:
                return target - now
            # Past the deadline, extensions spent, below the floor: only a receipt (which
            # wakes the driver) can change that.
            stalled = not self._due(now) and (
                self._open.extensions >= self.config.rounds.max_extensions
            )
            return np.inf if stalled else 0.0

    def poll(self) -> list[Outgoing]:
        """What to send now: collect requests, or the announcement of a round opened (or
        extended); nothing while nothing is due."""
        with self._lock:
            if self._done:
                return []
            now = self._clock()
            if self._collect is None:
                if not self._due(now):
                    return [self._announcement] if self._extended(now) else []
                self._collect = Collect(round=self._open.number, started=now)
                log.info(
                    "round %d: collecting from %d worker(s); %d client(s) receipted",
                    self._open.number, len(self.members), len(self._open.digests),
                    extra={"event": "collect", "round": self._open.number},
                )  # fmt: skip
            return self._collecting(now)

    def _due(self, now: float) -> bool:
        open_, rounds = self._open, self.config.rounds
        due = open_.close_time(rounds)
        if due is not None and now >= due:
            return True
        if now < open_.deadline:
            return False
        if self._count_unknown:
            return True  # a restart lost the count: the merged partials decide
        return open_.extensions >= rounds.max_extensions and len(open_.digests) >= rounds.floor

    def _extended(self, now: float) -> bool:
        """Past the deadline short of the quorum with extensions left: extend it."""
        open_, rounds = self._open, self.config.rounds
        if now < open_.deadline or open_.extensions >= rounds.max_extensions:
            return False
        open_.extend(now=now, timeout_s=rounds.timeout_s)
        self.metrics.round_extensions.set(open_.extensions)
        log.warning(
            "round %d: deadline passed with %d of %d required updates receipted; extended "
            "by %.0f s", open_.number, len(open_.digests), rounds.min_clients, rounds.timeout_s,
            extra={"event": "deadline_extended", "round": open_.number},
        )  # fmt: skip
        self._announcement = self.announcer.sign(
            dataclasses.replace(self._announcement, deadline=open_.deadline)
        )
        self.store.extend_deadline(open_.number, open_.deadline, self._announcement.to_wire())
        return True

    def _collecting(self, now: float) -> list[Outgoing]:
        collect = self._collect
        assert collect is not None
        waiting = collect.waiting(self.members)
        if not waiting:
            asks = plan(collect, members=self.members, statistics=self._statistics)
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
            return [self._close(now)]
        retry = self.config.workers.collect_retry_s
        if now < collect.asked_at + retry:
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

    def _globals(
        self, values: np.ndarray, has: np.ndarray, merged: PartialSum, round_: int
    ) -> Aggregate:
        """The global prototypes to announce: the merged partials', or, below
        ``rounds.floor`` (only after a restart lost the count), the last global state."""
        floor = self.config.rounds.floor
        if len(merged.clients) >= floor:
            return Aggregate(
                global_classes=tuple(int(c) for c in np.flatnonzero(has)),
                global_prototypes=values[has],
            )
        last = self._announcement
        log.warning(
            "round %d: collected %d update(s), below rounds.floor = %d; opening round %d "
            "with the last global state", round_, len(merged.clients), floor, round_ + 1,
        )  # fmt: skip
        return Aggregate(
            global_classes=last.global_classes,
            global_prototypes=np.asarray(last.global_prototypes, dtype=np.float64),
        )

    def _close(self, now: float) -> RoundAnnouncement:
        started = time.perf_counter()
        collect, closing = self._collect, self._open
        assert collect is not None and collect.asks is not None
        answers = {**collect.first, **collect.final}
        merged = combine(answers.values(), fleet=self.config.fleet, run=self.run_id,
                         round_=closing.number)  # fmt: skip
        rounds = self.config.rounds
        statistics, solved = self._statistics, None
        if statistics is not None:
            # Counted whatever rounds.floor says: the devices sent them once, have their
            # receipts and will not send them again.
            solved = statistics.solve(answers, round_=closing.number)
            result = solved.result
            values, has = _dense(result, self.config)
        else:
            assert self._mean is not None
            values, has = global_prototypes(merged, mean=self._mean)
            result = self._globals(values, has, merged, closing.number)
        self.closed = Closed(
            round=closing.number, merged=merged, values=values, has=has, result=result,
            statistics=None if solved is None else solved.total,
        )  # fmt: skip
        self.metrics.aggregation_seconds.observe(time.perf_counter() - started)
        finished = closing.number + 1
        final = rounds.max_rounds > 0 and finished >= rounds.max_rounds
        deadline = now if final else now + rounds.timeout_s
        nxt = self.announcer.announce(finished, result, deadline=deadline, final=final)
        if statistics is not None and solved is not None:
            statistics.save(solved)  # before the close commits: see its docstring
        self.store.advance(
            closing.number, closed_at=now, announcement=nxt.to_wire(), deadline=deadline,
            keep_rounds=rounds.keep_rounds, final=final,
        )  # fmt: skip
        if statistics is not None and solved is not None:
            statistics.committed(solved)
        shares = [
            Answer(worker=w, held=len(collect.first[w].partial.clients),
                   counted=len(answers[w].partial.clients), answered_at=collect.answered_at[w])
            for w in self.members
        ]  # fmt: skip
        self.ledger.record(closing.number, shares, keep_rounds=rounds.keep_rounds)
        if self.worker_metrics is not None:
            for share in shares:
                self.worker_metrics.held.labels(worker=share.worker).set(share.held)
        self.metrics.rounds_completed.inc()
        self.metrics.round_duration.observe(now - closing.opened_at)
        log.info(
            "round %d closed with %d update(s) from %d worker(s) (%s); opened round %d%s",
            closing.number, len(merged.clients), len(self.members),
            ", ".join(f"{s.worker} {s.counted}" for s in shares), finished,
            " (final)" if final else "",
            extra={"event": "round_closed", "round": closing.number,
                   "updates": len(merged.clients), "final": final},
        )  # fmt: skip
        self._open = OpenRound(number=finished, opened_at=now, deadline=deadline)
        self._collect = None
        self._count_unknown = False
        self._announcement, self._done = nxt, final
        self.metrics.round_extensions.set(0)
        self.metrics.round_opened.set(now)
        self.metrics.current_round.set(finished)
        return nxt


def _dense(result: Aggregate, config: CoordinatorConfig) -> tuple[np.ndarray, np.ndarray]:
    """An announced head's weight rows in the dense (C, d) layout, and its class mask."""
    values = np.zeros((len(config.model.classes), config.model.dim))
    has = np.zeros(len(config.model.classes), dtype=bool)
    classes = list(result.global_classes)
    values[classes] = result.global_prototypes
    has[classes] = True
    return values, has
