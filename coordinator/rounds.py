"""The round state machine: accept or reject updates, decide when a round closes,
aggregate, and produce the next announcement. Transport-free, so it is driven the same
way by the MQTT service, an in-memory fleet and the tests.

The manager is the one object the service talks to; it hands the devices' statuses to
:mod:`coordinator.presence`, checks updates with :mod:`coordinator.screening`, counts
rejections with :mod:`coordinator.rejections` and builds and signs what it sends with
:mod:`coordinator.announcements`."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from coordinator.announcements import Announcer
from coordinator.config import CoordinatorConfig
from coordinator.keys import CoordinatorKeys
from coordinator.metrics import Metrics
from coordinator.presence import Presence
from coordinator.rejections import Rejections
from coordinator.screening import Screening
from coordinator.store import Store
from coordinator.strategies import Aggregate, Strategy, make_strategy
from coordinator.strategies.closed_form import ClosedForm, statistics_of
from protocol import ProtocolError, PrototypeUpdate, RoundAnnouncement, Status
from protocol.methods import wire_method
from protocol.receipts import payload_digest
from runtime import closed_form as cf

log = logging.getLogger(__name__)

M = TypeVar("M")

ACCEPTED = "accepted"


@dataclass(frozen=True)
class Decision:
    """The outcome of offering one payload: ``reason`` is ``accepted`` or why not."""

    reason: str
    round: int | None = None
    client: str | None = None
    #: The SHA-256 of the update stored for (round, client), when one is: what the
    #: device's receipt names (for a duplicate, the digest of the first copy).
    digest: str | None = None

    @property
    def accepted(self) -> bool:
        return self.reason == ACCEPTED


class RoundManager:
    """Owns the open round. Thread-safe: updates arrive on the transport's thread while the
    service's loop calls :meth:`poll`."""

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
        self.run_id = store.run_id()
        self.metrics.insecure.set(1 if self.keys.insecure else 0)
        self.announcer = Announcer(config=config, keys=self.keys, run_id=self.run_id)
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
            log.info(
                "fleet %s: opened round 0",
                config.fleet,
                extra={"event": "round_opened", "round": 0},
            )
        else:
            log.info(
                "fleet %s: resuming at round %d with %d update(s) stored",
                config.fleet,
                latest.round,
                len(store.arrival_times(latest.round)),
                extra={"event": "resumed", "round": latest.round},
            )
        self._round = latest.round
        self._opened_at = latest.opened_at
        self._extensions = latest.extensions
        self._deadline = latest.deadline
        # Signed afresh: the key (or security.insecure) may have changed since it was stored.
        self._announcement = self.sign(
            RoundAnnouncement.from_wire(latest.announcement, max_bytes=1 << 62)
        )
        self._done = latest.closed_at is not None  # the final round is stored closed
        self.screening = Screening(
            admission=config.admission_checks(), keys=self.keys, run_id=self.run_id
        )
        self.screening.quarantine_failing(store, self.metrics, latest.round)
        # Digests of the open round's stored updates, by client, for receipts.
        self._digests: dict[str, str | None] = {
            c: payload_digest(p) for c, p in store.updates(latest.round)
        }
        # The open round's updates as decoded when they arrived: the close takes a stored
        # update from here instead of reading its payload back and decoding it again (most
        # of a close's work for a FedAvg round). Only an update this manager stored in this
        # round is here, and nothing rewrites a stored update (quarantine runs above, before
        # any arrives), so each is what the store holds. Empty after a restart: the close
        # then reads and decodes what the store holds.
        self._decoded: dict[str, PrototypeUpdate] = {}
        self._clients = set(self._digests)
        # Closed-form methods: the sum of every client's latest statistics (a device sends
        # them once per data version; the store keeps each client's latest), and the head
        # it solved, announced again until new statistics come. One running sum, not every
        # client's: 10,000 clients' second moments would not fit in memory.
        self._closed_form = wire_method(config.model.method).closed_form
        self._total: cf.Statistics | None = None
        self._held: set[str] = set()
        self._solved: Aggregate | None = None
        if self._closed_form:
            for client, payload in store.latest_statistics():
                try:
                    self._add_statistics(PrototypeUpdate.from_wire(payload, max_bytes=1 << 62))
                except (ProtocolError, ValueError) as exc:
                    # Stored by an earlier version under other bounds: the fleet's head goes
                    # on without it rather than the service failing every restart.
                    log.warning("the stored statistics of %s are left out: %s", client, exc)
        # Kept in memory (and rebuilt from the store on restart) so deciding whether a
        # round is due costs O(1) per update instead of a query over the whole round.
        self._arrivals = store.arrival_times(latest.round)
        self.rejections = Rejections(store=store, metrics=self.metrics)
        # Clients whose statuses are stored: enrolled or allow-listed, or ever accepted.
        self.presence = Presence(
            config=config,
            store=store,
            metrics=self.metrics,
            rejections=self.rejections,
            known=set(self.keys.devices) | set(config.rounds.allow_list) | store.contributors(),
            clock=clock,
        )
        self.metrics.current_round.set(self._round)
        self.metrics.round_opened.set(self._opened_at)
        self.metrics.round_extensions.set(self._extensions)
        have = len(self._arrivals)
        stalled = config.stalled(round_=self._round, updates=have, extensions=self._extensions)
        self.metrics.round_stalled.set(1 if stalled else 0)

    # -- state -------------------------------------------------------------------------

    @property
    def round(self) -> int:
        return self._round

    @property
    def announcement(self) -> RoundAnnouncement:
        """The announcement of the open round (retained on the broker)."""
        return self._announcement

    @property
    def done(self) -> bool:
        return self._done

    # -- updates -----------------------------------------------------------------------

    def offer(
        self, payload: bytes | bytearray, *, topic_client: str | None = None, receipt: bool = True
    ) -> Decision:
        """Validate and store one update payload, counting the outcome. ``receipt=False``
        for a driver with no device awaiting a receipt (the simulator's vector run): the
        payload's digest is not computed, and the decision (and a duplicate's) names none."""
        decision = self._judge(payload, topic_client, receipt)
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

    def _judge(
        self, payload: bytes | bytearray, topic_client: str | None, receipt: bool
    ) -> Decision:
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
            if self._done or update.round != self._round:
                return Decision("wrong_round", update.round, update.client)
            now = self._clock()
            if not self.store.add_update(
                self._round, update.client, bytes(payload), received_at=now
            ):
                stored = self._digests.get(update.client)
                return Decision("duplicate", update.round, update.client, stored)
            digest = self._digests[update.client] = payload_digest(payload) if receipt else None
            self._decoded[update.client] = update
            self._clients.add(update.client)
            self.presence.know(update.client)
            self._arrivals.append(now)
        return Decision(ACCEPTED, update.round, update.client, digest)

    def sign(self, message: M) -> M:
        """``message`` signed by the coordinator for this run (as is, when insecure)."""
        return self.announcer.sign(message)

    def record_status(
        self, payload: bytes | bytearray, *, topic_client: str | None = None
    ) -> Status | None:
        """Store a device's status message; None (and counted) when it is refused."""
        return self.presence.record(payload, topic_client=topic_client)

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
            if self._done:
                return None
            rounds = self.config.rounds
            arrivals = self._arrivals
            if len(arrivals) < rounds.min_clients:
                return None
            allow = rounds.allow_list
            if allow and set(allow) <= self._clients:
                return arrivals[-1]  # everyone expected has answered
            return min(
                arrivals[rounds.min_clients - 1] + rounds.wait_after_quorum_s, self._deadline
            )

    def seconds_until_due(self) -> float:
        """How long the driver may sleep before calling :meth:`poll` again."""
        now = self._clock()
        due = self.close_time()
        target = self._deadline if due is None else due
        return max(0.0, target - now)

    def poll(self) -> RoundAnnouncement | None:
        """Close the round if it is due; return the new announcement to publish, if any."""
        with self._lock:
            if self._done:
                return None
            now = self._clock()
            due = self.close_time()
            if due is None:
                if now < self._deadline:
                    return None
                rounds = self.config.rounds
                have = len(self._arrivals)
                if self._extensions >= rounds.max_extensions and have >= rounds.floor:
                    return self._close(now)  # with what it has, below the quorum
                self._extend(now)
                return self._announcement
            if now < due:
                return None
            return self._close(now)

    def _extend(self, now: float) -> None:
        have = len(self._arrivals)
        self._deadline = now + self.config.rounds.timeout_s
        self._extensions += 1
        stalled = self.config.stalled(round_=self._round, updates=have, extensions=self._extensions)
        self.metrics.round_extensions.set(self._extensions)
        self.metrics.round_stalled.set(1 if stalled else 0)
        log.warning(
            "round %d: deadline passed with %d of %d required updates; extended by %.0f s%s",
            self._round,
            have,
            self.config.rounds.min_clients,
            self.config.rounds.timeout_s,
            f" ({stalled})" if stalled else "",
            extra={
                "event": "deadline_extended",
                "round": self._round,
                "updates": have,
                "stalled": bool(stalled),
            },
        )
        self._announcement = self.sign(
            dataclasses.replace(self._announcement, deadline=self._deadline)
        )
        self.store.extend_deadline(self._round, self._deadline, self._announcement.to_wire())

    def _stored_update(self, client: str) -> PrototypeUpdate:
        """The update the store holds for ``client`` in the open round: the one decoded on
        arrival, else read and decoded now."""
        held = self._decoded.get(client)
        if held is not None:
            return held
        payload = self.store.update_payload(self._round, client)
        return PrototypeUpdate.from_wire(payload, max_bytes=1 << 62)

    def _add_statistics(self, update: PrototypeUpdate) -> None:
        model = self.config.model
        part = statistics_of(update, num_classes=len(model.classes), dim=model.dim)
        self._total = part if self._total is None else cf.merge([self._total, part])
        self._held.add(update.client)

    def _solve(self, updates: list[PrototypeUpdate]) -> tuple[Aggregate, dict[str, bytes]]:
        """A closed-form round: the round's new statistics replace their clients' earlier
        ones, and the head is solved from every client's latest (the same head again when
        none came). Returns it and the new statistics' payloads, stored with the close."""
        fresh = [u for u in updates if u.classes]
        model = self.config.model
        for update in fresh:
            if update.client in self._held and self._total is not None:
                old = PrototypeUpdate.from_wire(
                    self.store.statistics_of(update.client), max_bytes=1 << 62
                )
                self._total = cf.without(
                    self._total,
                    statistics_of(old, num_classes=len(model.classes), dim=model.dim),
                )
            self._add_statistics(update)
        if fresh or self._solved is None:
            strategy = self.strategy
            assert isinstance(strategy, ClosedForm)  # the method's record says it is
            self._solved = (
                Aggregate() if self._total is None else strategy.solve_statistics(self._total)
            )
        payloads = {
            u.client: self.store.update_payload(self._round, u.client)
            if self.store.keep_payloads
            else b""
            for u in fresh
        }
        return self._solved, payloads

    def _close(self, now: float) -> RoundAnnouncement:
        started = time.perf_counter()
        updates = [self._stored_update(c) for c in self.store.update_clients(self._round)]
        model = self.config.model
        fresh: dict[str, bytes] = {}
        if self._closed_form:
            result, fresh = self._solve(updates)
        else:
            result = self.strategy.aggregate(updates, num_classes=len(model.classes), dim=model.dim)
        self.metrics.aggregation_seconds.observe(time.perf_counter() - started)
        finished = self._round + 1
        final = self.config.rounds.max_rounds > 0 and finished >= self.config.rounds.max_rounds
        deadline = now if final else now + self.config.rounds.timeout_s
        nxt = self.announcer.announce(finished, result, deadline=deadline, final=final)
        self.store.advance(
            self._round,
            closed_at=now,
            announcement=nxt.to_wire(),
            deadline=deadline,
            keep_rounds=self.config.rounds.keep_rounds,
            final=final,
            statistics=fresh,
        )
        self.metrics.rounds_completed.inc()
        self.metrics.round_duration.observe(now - self._opened_at)
        if len(updates) < self.config.rounds.min_clients:
            log.warning(
                "round %d: closing with %d update(s), below min_clients = %d, after %d "
                "deadline extensions (rounds.max_extensions)",
                self._round,
                len(updates),
                self.config.rounds.min_clients,
                self._extensions,
            )
        log.info(
            "round %d closed with %d update(s) from %s; opened round %d%s",
            self._round,
            len(updates),
            ",".join(u.client for u in updates),
            finished,
            " (final)" if final else "",
            extra={
                "event": "round_closed",
                "round": self._round,
                "updates": len(updates),
                "final": final,
            },
        )
        self._round, self._opened_at, self._deadline = finished, now, deadline
        self._extensions = 0
        self.metrics.round_extensions.set(0)
        self.metrics.round_stalled.set(0)
        self.metrics.round_opened.set(now)
        self._announcement, self._done, self._clients, self._arrivals = nxt, final, set(), []
        self._digests = {}
        self._decoded = {}
        self.metrics.current_round.set(finished)
        return nxt
