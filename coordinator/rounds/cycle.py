"""A coordinator's round cycle, written once: run identity and resume, the open round and
its clock (quorum, ``wait_after_quorum_s``, deadline, extensions, floor, the stalled
gauge), the devices' statuses (and the skip past rounds a rolled-back database no longer
holds), the close transaction and the announcement. Transport-free, so the MQTT services,
the in-memory and vector fleets and the tests drive it the same way.

What a round's result is made of comes from a plugged-in tally (coordinator/rounds/tally.py),
and how updates come in from the driver: the single coordinator
(coordinator/rounds/manager.py) stores them itself; the round owner of a sharded fleet
(coordinator/tier/owner.py) counts the receipts its workers send.

::

    open r --(updates | receipts)--> due? --no, past deadline--> extend r, announce again
                                       |yes
                                       v
            tally.tally(r) --messages (a collect)--> sent; asked again
                                       |Tallied
                                       v
         one transaction: close r, open r+1, what the tally writes --> announce r+1
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from coordinator.config import CoordinatorConfig
from coordinator.keys import CoordinatorKeys
from coordinator.metrics import Metrics
from coordinator.rounds.announcements import Announcer
from coordinator.rounds.head_guard import report as report_head
from coordinator.rounds.open_round import OpenRound
from coordinator.rounds.presence import Presence
from coordinator.rounds.rejections import Rejections
from coordinator.rounds.run_history import RunHistory
from coordinator.rounds.run_reports import RunReports
from coordinator.rounds.screening import Screening
from coordinator.rounds.tally import Tallied, Tally
from coordinator.storage.store import Commit, RoundRow, Store
from coordinator.strategies import Aggregate
from protocol import PrototypeUpdate, RoundAnnouncement, Status
from protocol.methods import wire_method
from protocol.receipts import payload_digest

log = logging.getLogger(__name__)

M = TypeVar("M")


class RoundCycle(ABC):
    """The round's life (module text). Thread-safe: what the transport brings arrives on
    its thread while the driver's loop calls :meth:`_turn` (through ``poll``).

    A subclass says what plugs in: :meth:`_make_tally`, and how updates reach it."""

    def __init__(
        self,
        *,
        config: CoordinatorConfig,
        store: Store,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics or Metrics()
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
        store.bind_identity(config.identity())
        latest = store.latest_round()
        resumed = latest is not None
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
        self.tally = self._make_tally(latest, resumed=resumed)
        self.screening.quarantine_failing(store, self.metrics, latest.round)
        self._open = self._resume(latest)
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
        self._set_extensions(self._open)

    @abstractmethod
    def _make_tally(self, latest: RoundRow, *, resumed: bool) -> Tally:
        """Where this driver's round results come from; ``latest``: the round it resumes
        (or the first one), ``resumed``: the database held rounds before this start."""

    def _resume(self, latest: RoundRow) -> OpenRound:
        """The open round as the store holds it: the digests of its stored updates, by
        client, for receipts, and those updates given to the tally again."""
        digests: dict[str, str | None] = {}
        for client, payload in self.store.updates(latest.round):
            digests[client] = payload_digest(payload)
            if self.tally.takes_updates:
                self.tally.take(PrototypeUpdate.from_wire(payload, max_bytes=1 << 62))
        return OpenRound(
            number=latest.round, opened_at=latest.opened_at, deadline=latest.deadline,
            extensions=latest.extensions, arrivals=self.store.arrival_times(latest.round),
            digests=digests,
        )  # fmt: skip

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

    def sign(self, message: M) -> M:
        """``message`` signed by the coordinator for this run (as is, when insecure)."""
        return self.announcer.sign(message)

    # -- the devices' statuses and the counts of what was refused --------------------------

    def record_status(
        self, payload: bytes | bytearray, *, topic_client: str | None = None
    ) -> Status | None:
        """Store a device's status message; None (and counted) when it is refused."""
        return self.presence.record(payload, topic_client=topic_client)

    def _on_status(self, status: Status) -> None:
        with self._lock:
            self.reports.record(status)

    def update_online(self) -> None:
        """The online gauge: devices whose last status is online and fresher than
        ``rounds.online_ttl_s`` (devices restate it every round)."""
        self.presence.update_online()

    def count_rejection(self, reason: str) -> None:
        """Count one rejected message (written and logged in batches by
        :meth:`flush_rejections`)."""
        self.rejections.count(reason)

    def flush_rejections(self) -> dict[str, int]:
        """Write and log the rejections counted since the last flush; returns them. The
        service calls this every few seconds and when it stops."""
        return self.rejections.flush()

    def count_foreign_announcement(self) -> None:
        """Something other than this coordinator published on the round topic."""
        self.rejections.count("foreign_announcement")

    # -- deciding ------------------------------------------------------------------------

    def close_time(self) -> float | None:
        """When the open round may close, or None while it cannot (too few updates)."""
        with self._lock:
            return None if self._done else self._open.close_time(self.config.rounds)

    def seconds_until_due(self) -> float:
        """How long the driver may wait before calling ``poll`` again."""
        with self._lock:
            if self._done:
                return math.inf
            now = self._clock()
            wait = self.tally.wait_s(now)
            if wait is not None:
                return max(0.0, wait)
            due = self._open.close_time(self.config.rounds)
            target = self._open.deadline if due is None else min(due, self._open.deadline)
            return max(0.0, target - now)

    def _due(self, now: float) -> bool:
        open_, rounds = self._open, self.config.rounds
        due = open_.close_time(rounds)
        if due is not None:
            return now >= due
        if now < open_.deadline:
            return False
        if self.tally.count_unknown:
            return True  # a restart lost the count: the tally decides
        # Below the quorum after every extension: closed with what it has, above the floor.
        return open_.extensions >= rounds.max_extensions and len(open_.arrivals) >= rounds.floor

    def _turn(self) -> list[Any]:
        """What to send now: the announcement of a round opened or extended, or the
        tally's messages while its close is under way; nothing while nothing is due."""
        with self._lock:
            if self._done:
                return []
            now = self._clock()
            tally = self.tally
            open_ = self._open
            if tally.wait_s(now) is None:  # no close under way
                behind = self.reports.answered_past(open_, deadline_passed=now >= open_.deadline)
                if behind is not None:
                    return [self._skip_to(behind + 1, now)]
            if tally.closes_itself:
                # Closed by its own outcome, whose stages have their own deadlines: not by
                # updates, which carry no statistics here.
                return self._close(now) if tally.ready() else []
            if tally.wait_s(now) is None and not self._due(now):
                if now < open_.deadline:
                    return []
                self._extend(now)
                return [self._announcement]
            return self._close(now)

    def _set_extensions(self, open_: OpenRound) -> str | None:
        """The extension and stalled gauges of ``open_``; why it is stalled, if it is."""
        stalled = self.config.stalled(
            round_=open_.number, updates=len(open_.arrivals), extensions=open_.extensions
        )
        self.metrics.round_extensions.set(open_.extensions)
        self.metrics.round_stalled.set(1 if stalled else 0)
        return stalled

    def _extend(self, now: float) -> None:
        open_ = self._open
        have = len(open_.arrivals)
        open_.extend(now=now, timeout_s=self.config.rounds.timeout_s)
        stalled = self._set_extensions(open_)
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

    # -- closing -------------------------------------------------------------------------

    def _skip_to(self, round_: int, now: float) -> RoundAnnouncement:
        """Open round ``round_`` past the open one without aggregating it: the devices
        answered rounds this database no longer holds (it was rolled back), and would
        refuse every round up to theirs as already answered. The global state is the open
        round's announcement's; the open round's updates are dropped (their devices answer
        ``round_``), its closed-form statistics kept, a secure fleet's sum started again."""
        closing, deadline = self._open, now + self.config.rounds.timeout_s
        meta, extras = self.tally.rolled_back(round_)
        last = self._announcement
        nxt = self.sign(dataclasses.replace(last, round=round_, deadline=deadline,
                                            extras={**last.extras, **extras}))  # fmt: skip
        self.store.advance(
            Commit(
                closing.number, closed_at=now, announcement=nxt.to_wire(), deadline=deadline,
                keep_rounds=self.config.rounds.keep_rounds, statistics=self.tally.skipped(),
                next_round=round_, meta=meta,
            )
        )  # fmt: skip
        self.tally.committed(None)
        log.warning(
            "round %d: devices have answered up to round %d of run %s, which %s no longer "
            "holds (a rolled-back database); opened round %d with the last global state "
            "and dropped %d update(s) of round %d",
            closing.number, round_ - 1, self.run_id, self.store.path, round_,
            len(closing.arrivals), closing.number,
            extra={"event": "rounds_skipped", "round": round_},
        )  # fmt: skip
        self._opened(OpenRound(number=round_, opened_at=now, deadline=deadline), nxt)
        return nxt

    def _close(self, now: float) -> list[Any]:
        started = time.perf_counter()
        closing = self._open
        tallied = self.tally.tally(closing, now=now, last=self._announcement)
        if not isinstance(tallied, Tallied):
            return list(tallied)  # the tally's messages first; it is asked again
        self.metrics.aggregation_seconds.observe(time.perf_counter() - started)
        rounds = self.config.rounds
        finished = closing.number + 1
        final = rounds.max_rounds > 0 and finished >= rounds.max_rounds
        deadline = now if final else now + rounds.timeout_s
        nxt = self.announcer.announce(finished, tallied.aggregate, deadline=deadline, final=final)
        self.tally.before_commit(tallied)
        kept = report_head(
            round_=closing.number,
            kept=tallied.kept,
            clients=tallied.statistics,
            metrics=self.metrics,
            closed_form=wire_method(self.config.model.method).closed_form,
        )
        self.store.advance(
            Commit(
                closing.number, closed_at=now, announcement=nxt.to_wire(), deadline=deadline,
                keep_rounds=rounds.keep_rounds, final=final, statistics=tallied.statistics,
                meta={**tallied.meta, **kept},
            )
        )  # fmt: skip
        self.tally.committed(tallied)
        self.metrics.rounds_completed.inc()
        self.metrics.round_duration.observe(now - closing.opened_at)
        if tallied.counted and tallied.updates < rounds.min_clients:
            log.warning(
                "round %d: closing with %d update(s), below min_clients = %d, after %d "
                "deadline extensions (rounds.max_extensions)",
                closing.number, tallied.updates, rounds.min_clients, closing.extensions,
            )  # fmt: skip
        log.info(
            "round %d closed with %d update(s) from %s; opened round %d%s",
            closing.number, tallied.updates, tallied.source, finished,
            " (final)" if final else "",
            extra={"event": "round_closed", "round": closing.number,
                   "updates": tallied.updates, "final": final},
        )  # fmt: skip
        self._opened(OpenRound(number=finished, opened_at=now, deadline=deadline), nxt)
        self._done = final
        return [nxt]

    def _opened(self, open_: OpenRound, announcement: RoundAnnouncement) -> None:
        self._open, self._announcement = open_, announcement
        self.metrics.round_extensions.set(0)
        self.metrics.round_stalled.set(0)
        self.metrics.round_opened.set(open_.opened_at)
        self.metrics.current_round.set(open_.number)
