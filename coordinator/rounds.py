"""The round state machine: accept or reject updates, decide when a round closes,
aggregate, and produce the next announcement. Transport-free, so it is driven the same
way by the MQTT service, an in-memory fleet and the tests.

The manager is the one object the service talks to; it hands the devices' statuses to
:mod:`coordinator.presence`, checks updates with :mod:`coordinator.screening`, counts
rejections with :mod:`coordinator.rejections`, keeps the open round's arrivals and
deadline in :mod:`coordinator.open_round` and builds and signs what it sends with
:mod:`coordinator.announcements`."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from coordinator.announcements import Announcer
from coordinator.config import CoordinatorConfig
from coordinator.decision import ACCEPTED, Decision
from coordinator.keys import CoordinatorKeys
from coordinator.metrics import Metrics
from coordinator.open_round import OpenRound
from coordinator.presence import Presence
from coordinator.rejections import Rejections
from coordinator.run_history import RunHistory
from coordinator.run_reports import RunReports
from coordinator.screening import Screening
from coordinator.secure_rounds import SUM_KEY, FleetSum, SecureOutcome
from coordinator.statistics import FleetStatistics
from coordinator.store import Store
from coordinator.strategies import Aggregate, Strategy, make_strategy
from coordinator.strategies.closed_form import ClosedForm
from protocol import ProtocolError, PrototypeUpdate, RoundAnnouncement, Status
from protocol.methods import wire_method
from protocol.receipts import payload_digest
from runtime.secagg.fleet import (
    SecureRelease,
    global_prototypes,
    prototype_release,
    secure_release,
    unflatten,
)

log = logging.getLogger(__name__)

M = TypeVar("M")


class RoundManager:
    """Owns the open round. Thread-safe: updates arrive on the transport's thread while the
    service's loop calls :meth:`poll`.

    A driver with no devices awaiting receipts may override the two steps that serve
    them: what is kept of an update just stored (:meth:`_stored`) and how the close reads
    the round's updates back (:meth:`_stored_update`)."""

    def __init__(
        self,
        *,
        config: CoordinatorConfig,
        store: Store,
        metrics: Metrics | None = None,
        strategy: Strategy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics or Metrics()
        self.strategy = strategy or make_strategy(
            config.model.method, robust=config.robust, **dict(config.model.strategy)
        )
        self._clock = clock
        self._lock = threading.RLock()
        self.keys = CoordinatorKeys.load(config.security)
        short = self.keys.quorum_problem(config.rounds.min_clients)
        if short:
            log.warning("%s", short)
        self.run_id, self.run_started = store.run(now=clock())
        self.metrics.insecure.set(1 if self.keys.insecure else 0)
        self.announcer = Announcer(
            config=config, keys=self.keys, run_id=self.run_id, run_started=self.run_started
        )
        store.bind_identity(
            {"fleet": config.fleet, "method": config.model.method, "bundle": config.model.bundle}
        )
        latest = store.latest_round()
        now = clock()
        if latest is None:
            first = self.announcer.announce(0, Aggregate(), deadline=now + config.rounds.timeout_s)
            store.open_first_round(first.to_wire(), opened_at=now, deadline=first.deadline)
            latest = store.latest_round()
            assert latest is not None
            self._announce_new_run(store)
        else:
            log.info(
                "fleet %s: resuming at round %d with %d update(s) stored",
                config.fleet,
                latest.round,
                len(store.arrival_times(latest.round)),
                extra={"event": "resumed", "round": latest.round},
            )
        # Signed afresh: the key (or security.insecure) may have changed since it was stored.
        self._announcement = self.sign(
            RoundAnnouncement.from_wire(latest.announcement, max_bytes=1 << 62)
        )
        self._done = latest.closed_at is not None  # the final round is stored closed
        self.screening = Screening(
            admission=config.admission_checks(), keys=self.keys, run_id=self.run_id
        )
        # Closed-form methods: the sum of every client's latest statistics, and the head it
        # solves, announced again until new statistics come (coordinator/statistics.py).
        self._statistics: FleetStatistics | None = None
        wire = wire_method(config.model.method)
        # A secure fleet (privacy.aggregation = "secure"): each round's head is solved from
        # the sum its secure-aggregation round unmasks (coordinator/secure_rounds.py); no
        # device's statistics are ever stored here, so none are summed update by update.
        self.secure: SecureRelease | None = None
        self._secure_outcome: SecureOutcome | None = None
        self._secure_sum: FleetSum | None = None
        if config.secure and not wire.closed_form:
            # FedProto: each round's global prototypes from that round's summed rows.
            self.secure = prototype_release(
                config.secure_aggregation, dim=config.model.dim, classes=len(config.model.classes)
            )
        elif config.secure:
            self.secure = secure_release(
                config.secure_aggregation,
                k=config.model.dim,
                classes=len(config.model.classes),
                gram=wire.gram,
                devices=len(self.keys.devices) or None,
            )
            self._secure_sum = FleetSum.load(
                store.meta_value(SUM_KEY), length=self.secure.settings.length
            )
        elif wire.closed_form:
            assert isinstance(self.strategy, ClosedForm)  # the method's record says it is
            self._statistics = FleetStatistics(
                store=store, strategy=self.strategy, num_classes=len(config.model.classes),
                dim=config.model.dim, gram=wire.gram,
                admissible=lambda u: self.screening.admission.check(u),
            )  # fmt: skip
        self.screening.quarantine_failing(store, self.metrics, latest.round)
        # Digests of the open round's stored updates, by client, for receipts; the
        # statistics among them are the open round's again.
        digests: dict[str, str | None] = {}
        for client, payload in store.updates(latest.round):
            digests[client] = payload_digest(payload)
            if self._statistics is not None:
                stored = PrototypeUpdate.from_wire(payload, max_bytes=1 << 62)
                if stored.classes:
                    self._statistics.take(stored)
        self._open = OpenRound(
            number=latest.round, opened_at=latest.opened_at, deadline=latest.deadline,
            extensions=latest.extensions, arrivals=store.arrival_times(latest.round),
            digests=digests,
        )  # fmt: skip
        self.rejections = Rejections(store=store, metrics=self.metrics)
        # Clients whose statuses are stored: enrolled or allow-listed, or ever accepted.
        # What the devices say they answered in this run, and the runs they follow that
        # this database does not hold: a rolled-back or lost database learns it here.
        self.reports = RunReports(run=self.run_id, path=store.path)
        self.presence = Presence(
            config=config,
            store=store,
            metrics=self.metrics,
            rejections=self.rejections,
            known=set(self.keys.devices) | set(config.rounds.allow_list) | store.contributors(),
            clock=clock,
            on_status=self._on_status,
        )
        self.metrics.current_round.set(self._open.number)
        self.metrics.round_opened.set(self._open.opened_at)
        self.metrics.round_extensions.set(self._open.extensions)
        have = len(self._open.arrivals)
        stalled = config.stalled(
            round_=self._open.number, updates=have, extensions=self._open.extensions
        )
        self.metrics.round_stalled.set(1 if stalled else 0)

    def _announce_new_run(self, store: Store) -> None:
        """Say that this database starts a run: out loud when the folder held runs before
        or the database was an empty file (its state was lost: the devices adopt this run,
        which started later than theirs), quietly on a fleet's first start."""
        history = RunHistory.beside(store.path)
        before = history.runs()
        if before or store.empty_file:
            last = before[-1]["run"] if before else "unknown"
            log.warning(
                "fleet %s: no database at %s (%s): started run %s at round 0; the state of "
                "run %s is lost. Its devices adopt this run when they hear it (docs/deploy.md, "
                "'A lost or rolled-back database')",
                self.config.fleet, store.path,
                "an empty file" if store.empty_file else "missing", self.run_id, last,
                extra={"event": "run_started", "round": 0, "run": self.run_id},
            )  # fmt: skip
        else:
            log.info(
                "fleet %s: started run %s at round 0 (a new database at %s)",
                self.config.fleet, self.run_id, store.path,
                extra={"event": "run_started", "round": 0, "run": self.run_id},
            )  # fmt: skip
        history.add(self.run_id, self.run_started)

    # -- state -------------------------------------------------------------------------

    @property
    def round(self) -> int:
        return self._open.number

    @property
    def announcement(self) -> RoundAnnouncement:
        """The announcement of the open round (retained on the broker)."""
        return self._announcement

    @property
    def done(self) -> bool:
        return self._done

    # -- updates -----------------------------------------------------------------------

    def offer(self, payload: bytes | bytearray, *, topic_client: str | None = None) -> Decision:
        """Validate and store one update payload, counting the outcome."""
        decision = self._judge(payload, topic_client)
        if decision.accepted:
            self.metrics.updates_accepted.inc()
            assert decision.client is not None and decision.round is not None
            self.metrics.client_last_accepted.labels(client=decision.client).set(decision.round)
        else:
            self.rejections.reject_update(
                decision.reason, round_=decision.round, client=decision.client or topic_client
            )
        return decision

    def count_rejection(self, reason: str) -> None:
        """Count one rejected message (written and logged in batches by
        :meth:`flush_rejections`)."""
        self.rejections.count(reason)

    def flush_rejections(self) -> dict[str, int]:
        """Write and log the rejections counted since the last flush; returns them. The
        service calls this every few seconds and when it stops."""
        return self.rejections.flush()

    def _judge(self, payload: bytes | bytearray, topic_client: str | None) -> Decision:
        try:
            update = PrototypeUpdate.from_wire(
                payload, max_bytes=self.config.mqtt.max_payload_bytes
            )
        except ProtocolError as exc:
            return Decision(exc.reason)
        reject = self.screening.problem(update, topic_client=topic_client)
        if reject:
            return Decision(reject, update.round, update.client)
        with self._lock:
            open_ = self._open
            if self._done or update.round != open_.number:
                return Decision("wrong_round", update.round, update.client)
            now = self._clock()
            if not self.store.add_update(
                open_.number, update.client, bytes(payload), received_at=now
            ):
                stored = open_.digests.get(update.client)
                return Decision("duplicate", update.round, update.client, stored)
            if self.secure is not None and update.classes:
                # A device configured for plain aggregation in a secure fleet: its
                # statistics are not kept, and its operator learns why from the count.
                return Decision("not_secure", update.round, update.client)
            digest = open_.digests[update.client] = self._stored(update, payload)
            if self._statistics is not None and update.classes:
                # Added to the round's sum now and let go: a round of 10,000 clients'
                # statistics is not held update by update.
                self._statistics.take(update)
            self.presence.know(update.client)
            open_.arrivals.append(now)
        return Decision(ACCEPTED, update.round, update.client, digest)

    def _stored(self, update: PrototypeUpdate, payload: bytes | bytearray) -> str | None:
        """``update``, received as ``payload``, is now stored in the open round (called
        under the lock): the digest its receipt names."""
        return payload_digest(payload)

    def sign(self, message: M) -> M:
        """``message`` signed by the coordinator for this run (as is, when insecure)."""
        return self.announcer.sign(message)

    def record_status(
        self, payload: bytes | bytearray, *, topic_client: str | None = None
    ) -> Status | None:
        """Store a device's status message; None (and counted) when it is refused."""
        return self.presence.record(payload, topic_client=topic_client)

    def _on_status(self, status: Status) -> None:
        with self._lock:
            self.reports.record(status)

    def count_foreign_announcement(self) -> None:
        """Something other than this coordinator published on the round topic."""
        self.rejections.count("foreign_announcement")

    def update_online(self) -> None:
        """The online gauge: devices whose last status is online and fresher than
        ``rounds.online_ttl_s`` (devices restate it every round)."""
        self.presence.update_online()

    # -- closing -----------------------------------------------------------------------

    def close_time(self) -> float | None:
        """When the open round may close, or None while it cannot (too few updates)."""
        with self._lock:
            return None if self._done else self._open.close_time(self.config.rounds)

    def seconds_until_due(self) -> float:
        """How long the driver may sleep before calling :meth:`poll` again."""
        now = self._clock()
        due = self.close_time()
        target = self._open.deadline if due is None else due
        return max(0.0, target - now)

    def take_secure(self, outcome: SecureOutcome) -> bool:
        """The open round's secure aggregation has ended (coordinator/secure_rounds.py):
        :meth:`poll` closes the round with it. False for another round's (a late one)."""
        with self._lock:
            if self._done or self.secure is None or outcome.round != self._open.number:
                return False
            self._secure_outcome = outcome
            return True

    def poll(self) -> RoundAnnouncement | None:
        """Close the round if it is due; return the new announcement to publish, if any."""
        with self._lock:
            if self._done:
                return None
            now = self._clock()
            if self.secure is not None:
                # Closed by its secure-aggregation round, whose stages have their own
                # deadlines: not by updates, which carry no statistics here.
                outcome, self._secure_outcome = self._secure_outcome, None
                return None if outcome is None else self._close(now, secure=outcome)
            behind = self.reports.answered_past(
                self._open, deadline_passed=now >= self._open.deadline
            )
            if behind is not None:
                return self._skip_to(behind + 1, now)
            due = self.close_time()
            if due is None:
                if now < self._open.deadline:
                    return None
                rounds = self.config.rounds
                have = len(self._open.arrivals)
                if self._open.extensions >= rounds.max_extensions and have >= rounds.floor:
                    return self._close(now)  # with what it has, below the quorum
                self._extend(now)
                return self._announcement
            if now < due:
                return None
            return self._close(now)

    def _extend(self, now: float) -> None:
        open_ = self._open
        have = len(open_.arrivals)
        open_.extend(now=now, timeout_s=self.config.rounds.timeout_s)
        stalled = self.config.stalled(
            round_=open_.number, updates=have, extensions=open_.extensions
        )
        self.metrics.round_extensions.set(open_.extensions)
        self.metrics.round_stalled.set(1 if stalled else 0)
        log.warning(
            "round %d: deadline passed with %d of %d required updates; extended by %.0f s%s",
            open_.number,
            have,
            self.config.rounds.min_clients,
            self.config.rounds.timeout_s,
            f" ({stalled})" if stalled else "",
            extra={
                "event": "deadline_extended",
                "round": open_.number,
                "updates": have,
                "stalled": bool(stalled),
            },
        )
        self._announcement = self.sign(
            dataclasses.replace(self._announcement, deadline=open_.deadline)
        )
        self.store.extend_deadline(open_.number, open_.deadline, self._announcement.to_wire())

    def _skip_to(self, round_: int, now: float) -> RoundAnnouncement:
        """Open round ``round_`` past the open one without aggregating it: the devices
        answered rounds this database no longer holds (it was rolled back), and would
        refuse every round up to theirs as already answered. The global state is the open
        round's announcement's; the open round's updates are dropped (their devices answer
        ``round_``), its closed-form statistics kept."""
        closing = self._open
        deadline = now + self.config.rounds.timeout_s
        nxt = self.sign(dataclasses.replace(self._announcement, round=round_, deadline=deadline))
        fresh = list(self._statistics.round_clients) if self._statistics is not None else []
        self.store.advance(
            closing.number, closed_at=now, announcement=nxt.to_wire(), deadline=deadline,
            keep_rounds=self.config.rounds.keep_rounds, statistics=fresh, next_round=round_,
        )  # fmt: skip
        if self._statistics is not None:
            self._statistics.committed()
        log.warning(
            "round %d: devices have answered up to round %d of run %s, which %s no longer "
            "holds (a rolled-back database); opened round %d with the last global state "
            "and dropped %d update(s) of round %d",
            closing.number, round_ - 1, self.run_id, self.store.path, round_,
            len(closing.arrivals), closing.number,
            extra={"event": "rounds_skipped", "round": round_},
        )  # fmt: skip
        self._open = OpenRound(number=round_, opened_at=now, deadline=deadline)
        self.metrics.round_extensions.set(0)
        self.metrics.round_stalled.set(0)
        self.metrics.round_opened.set(now)
        self.metrics.current_round.set(round_)
        self._announcement = nxt
        return nxt

    def _stored_update(self, client: str) -> PrototypeUpdate:
        """The update the store holds for ``client`` in the open round, decoded."""
        payload = self.store.update_payload(self._open.number, client)
        return PrototypeUpdate.from_wire(payload, max_bytes=1 << 62)

    def _secure_result(self, outcome: SecureOutcome) -> tuple[Aggregate, FleetSum | None]:
        """The fleet's running sum with the round's added, and the head it solves (the
        same head again when the round aborted)."""
        release, before = self.secure, self._secure_sum
        assert release is not None
        if outcome.total is None:
            log.warning(
                "round %d: secure aggregation aborted (%s); the last global state stays",
                outcome.round, outcome.why,
                extra={"event": "secure_aborted", "round": outcome.round},
            )  # fmt: skip
        if release.prototypes:
            return self._secure_prototypes(outcome), before
        assert before is not None
        after = before.plus(outcome)
        if after.devices == 0:
            return Aggregate(), after
        stats = unflatten(
            after.total, k=release.k, classes=release.classes, gram=release.gram,
            devices=after.devices,
        )  # fmt: skip
        assert isinstance(self.strategy, ClosedForm)  # config.secure_problem checked it
        # The sum's noise is public (the plan's): the solve keeps the directions it swamps
        # from being amplified (runtime/closed_form/heads.py::lda_head).
        noise = 0.0
        if release.plan is not None:
            noise = release.plan.sum_std(max(after.devices, release.plan.release.threshold))
        return self.strategy.solve_statistics(stats, noise_std=noise), after

    def _secure_prototypes(self, outcome: SecureOutcome) -> Aggregate:
        """FedProto's global prototypes of the round's sum; the announced ones again when
        the round aborted."""
        release = self.secure
        assert release is not None
        if outcome.total is None:
            held = self._announcement
            return Aggregate(
                global_classes=held.global_classes,
                global_prototypes=np.asarray(held.global_prototypes, dtype=np.float64),
            )
        rows, has = global_prototypes(outcome.total, dim=release.k, classes=release.classes)
        return Aggregate(
            global_classes=tuple(int(c) for c in np.flatnonzero(has)), global_prototypes=rows[has]
        )

    def _close(self, now: float, *, secure: SecureOutcome | None = None) -> RoundAnnouncement:
        started = time.perf_counter()
        closing = self._open
        clients = self.store.update_clients(closing.number)
        model = self.config.model
        fresh: list[str] = []
        meta: dict[str, str] = {}
        if secure is not None:
            result, fleet_sum = self._secure_result(secure)
            if fleet_sum is not None:
                meta[SUM_KEY] = fleet_sum.to_meta()
        elif self._statistics is not None:  # summed as they arrived
            result = self._statistics.solve()
            fresh = list(self._statistics.round_clients)
        else:
            updates = [self._stored_update(c) for c in clients]
            result = self.strategy.aggregate(updates, num_classes=len(model.classes), dim=model.dim)
        self.metrics.aggregation_seconds.observe(time.perf_counter() - started)
        finished = closing.number + 1
        final = self.config.rounds.max_rounds > 0 and finished >= self.config.rounds.max_rounds
        deadline = now if final else now + self.config.rounds.timeout_s
        nxt = self.announcer.announce(finished, result, deadline=deadline, final=final)
        self.store.advance(
            closing.number,
            closed_at=now,
            announcement=nxt.to_wire(),
            deadline=deadline,
            keep_rounds=self.config.rounds.keep_rounds,
            final=final,
            statistics=fresh,
            meta=meta,
        )
        if self._statistics is not None:
            self._statistics.committed()
        if secure is not None:
            self._secure_sum = fleet_sum
        self.metrics.rounds_completed.inc()
        self.metrics.round_duration.observe(now - closing.opened_at)
        if secure is None and len(clients) < self.config.rounds.min_clients:
            log.warning(
                "round %d: closing with %d update(s), below min_clients = %d, after %d "
                "deadline extensions (rounds.max_extensions)",
                closing.number,
                len(clients),
                self.config.rounds.min_clients,
                closing.extensions,
            )
        if secure is not None and secure.total is not None:
            log.info(
                "round %d: head solved from the secure sum of %d device(s) (%.1f s)",
                closing.number, secure.survivors, secure.seconds,
                extra={"event": "secure_sum", "round": closing.number,
                       "devices": secure.survivors, "seconds": secure.seconds},
            )  # fmt: skip
        log.info(
            "round %d closed with %d update(s) from %s; opened round %d%s",
            closing.number,
            len(clients),
            ",".join(clients),
            finished,
            " (final)" if final else "",
            extra={
                "event": "round_closed",
                "round": closing.number,
                "updates": len(clients),
                "final": final,
            },
        )
        self._open = OpenRound(number=finished, opened_at=now, deadline=deadline)
        self.metrics.round_extensions.set(0)
        self.metrics.round_stalled.set(0)
        self.metrics.round_opened.set(now)
        self._announcement, self._done = nxt, final
        self.metrics.current_round.set(finished)
        return nxt
