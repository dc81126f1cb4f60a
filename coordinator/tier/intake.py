"""A coordinator worker's intake, transport-free: what it does to an announcement, an
update and a collect request (coordinator/tier/worker.py carries them over MQTT).

- **The open round** is learnt from the coordinator's retained announcement, taken only
  when the coordinator signed it (unless the fleet runs insecure), and only forward: a
  later round of the run it follows, or a run that started later. A replayed old
  announcement cannot roll a worker back. It is kept in the worker's database, so a
  restarted worker judges its redelivered updates before the broker repeats it.
- **An update** passes the coordinator's own checks (:class:`coordinator.rounds.screening.
  Screening`: admission, then the enrolled device's signature for the run), must be of
  the open round, and is committed to the worker's database before anything answers it.
  The first copy per (run, round, client) stands; a duplicate is answered with the
  receipt of the stored copy, as the coordinator answers one.
- **A receipt** is signed with the coordinator's key, which the worker holds: devices
  check receipts against the coordinator key they pinned.
- **A partial sum** is recomputed from the stored rows on every request, leaving out the
  clients the combiner names (coordinator/tier/partial_wire.py), and a round once collected
  takes no more updates. For a closed-form method it carries the summed statistics of
  the updates that hold some, and those of the earlier copies the combiner asks for
  back (coordinator/tier/partial_statistics.py, coordinator/tier/owner_statistics.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from coordinator.admission import Admission
from coordinator.decision import ACCEPTED, Decision
from coordinator.keys import CoordinatorKeys
from coordinator.rounds.screening import Screening, quarantined
from coordinator.tier.partial import PartialSum, merge, partial_of
from coordinator.tier.partial_statistics import StatisticsPart, merge_parts, part_of
from coordinator.tier.partial_wire import Copy, PartialMessage
from coordinator.tier.worker_store import OpenRound, WorkerStore
from protocol import DEFAULT_MAX_PAYLOAD_BYTES, ProtocolError, PrototypeUpdate, RoundAnnouncement
from protocol.auth import Verifier, sign, signature_problem
from protocol.limits import PROTOCOL_VERSION
from protocol.methods import wire_method
from protocol.receipts import Receipt, payload_digest
from protocol.topics import parse_topic

log = logging.getLogger(__name__)

#: An announcement may carry FedAvg's weights: far more than an update.
MAX_ANNOUNCEMENT_BYTES = 64 << 20
#: Updates decoded at once when a partial is recomputed: bounds its memory, not its sum.
CHUNK = 1024


class Intake:
    """One worker's judgement and state. Thread-safe; every method that writes commits
    before it returns."""

    def __init__(
        self,
        *,
        name: str,
        admission: Admission,
        keys: CoordinatorKeys,
        store: WorkerStore,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self.fleet = admission.fleet
        self.admission = admission
        self.keys = keys
        self.store = store
        self.max_payload_bytes = max_payload_bytes
        self._clock = clock
        self._lock = threading.RLock()
        self._rejected: Counter[str] = Counter()
        store.bind(fleet=self.fleet, worker=name)
        self._open = store.open_round()
        self._screening = self._screen_for(self._open)
        self._rescreen()

    # -- state --------------------------------------------------------------------------

    @property
    def open_round(self) -> OpenRound | None:
        with self._lock:
            return self._open

    @property
    def rejected(self) -> dict[str, int]:
        """Messages refused, by reason (the coordinator's names)."""
        with self._lock:
            return dict(self._rejected)

    def _refuse(self, reason: str) -> str:
        with self._lock:
            self._rejected[reason] += 1
        return reason

    def _screen_for(self, open_: OpenRound | None) -> Screening | None:
        if open_ is None:
            return None
        return Screening(admission=self.admission, keys=self.keys, run_id=open_.run)

    def _rescreen(self) -> None:
        """At a (re)start, set aside the open round's stored updates that today's checks
        refuse, as the single coordinator does when it resumes: aggregating them could
        fail every collect. Counted as ``quarantined``."""
        open_, screening = self._open, self._screening
        if open_ is None or screening is None or self.store.collected(open_.run, open_.round):
            return
        stored = ((row.client, row.payload) for row in self.store.updates(open_.run, open_.round))
        for client, reason in list(screening.failing(stored, round_=open_.round)):
            self.store.quarantine(open_.run, open_.round, client, reason)
            self._refuse("quarantined")
            quarantined(open_.round, client, reason, worker=self.name)

    @property
    def _coordinator(self) -> Verifier | None:
        return None if self.keys.signer is None else self.keys.signer.public

    # -- announcements ------------------------------------------------------------------

    def hear(self, payload: bytes | bytearray) -> str | None:
        """Take the announcement retained on the round topic; why not, or None if taken
        (or already known). A refusal is counted as ``foreign_announcement``, an
        announcement behind the one held as ``stale_announcement``."""
        try:
            heard = RoundAnnouncement.from_wire(payload, max_bytes=MAX_ANNOUNCEMENT_BYTES)
        except ProtocolError as exc:
            log.warning("worker %s: an undecodable announcement (%s)", self.name, exc)
            return self._refuse("foreign_announcement")
        problem = "wrong_fleet" if heard.fleet != self.fleet else None
        if problem is None and not self.keys.insecure:
            problem = signature_problem(heard, self._coordinator, run=heard.run)
        if problem is not None:
            log.warning(
                "worker %s: an announcement of round %d not from the coordinator (%s): ignored",
                self.name, heard.round, problem,
            )  # fmt: skip
            return self._refuse("foreign_announcement")
        new = OpenRound(run=heard.run, run_started=heard.run_started, round=heard.round)
        with self._lock:
            old = self._open
            if old is not None and not _later(new, old):
                return None if new == old else self._refuse("stale_announcement")
            self.store.save_open_round(new)
            self._open, self._screening = new, self._screen_for(new)
        log.info(
            "worker %s: round %d of run %s is open", self.name, new.round, new.run,
            extra={"event": "round_heard", "round": new.round, "run": new.run},
        )  # fmt: skip
        return None

    # -- updates ------------------------------------------------------------------------

    def offer(self, payload: bytes | bytearray, *, topic: str) -> Decision:
        """Judge and store one update that came on ``topic``; refusals are counted."""
        decision, version = self._judge(payload, topic)
        # Its receipt is written in the update's version (docs/protocol.md, Versions).
        decision = dataclasses.replace(decision, wire_version=version)
        if not decision.accepted:
            self._refuse(decision.reason)
        return decision

    def _judge(self, payload: bytes | bytearray, topic: str) -> tuple[Decision, int]:
        try:
            topic_client = parse_topic(topic).client
            update = PrototypeUpdate.from_wire(payload, max_bytes=self.max_payload_bytes)
        except ProtocolError as exc:
            return Decision(exc.reason), PROTOCOL_VERSION
        return self._judge_update(update, payload, topic_client), update.wire_version

    def _judge_update(
        self, update: PrototypeUpdate, payload: bytes | bytearray, topic_client: str | None
    ) -> Decision:
        with self._lock:
            open_, screening = self._open, self._screening
        if screening is None:
            # No round heard of yet: as the coordinator refuses an update of a round it
            # has not opened. The device resends until a receipt names it.
            problem = self.admission.check(update, topic_client=topic_client)
            return Decision(problem or "wrong_round", update.round, update.client)
        problem = screening.problem(update, topic_client=topic_client)
        if problem is not None:
            return Decision(problem, update.round, update.client)
        assert open_ is not None
        if update.round != open_.round or self.store.collected(open_.run, open_.round):
            return Decision("wrong_round", update.round, update.client)
        digest = payload_digest(payload)
        stored = self.store.add(
            run=open_.run, round_=update.round, client=update.client, digest=digest,
            payload=bytes(payload), now=self._clock(),
        )  # fmt: skip
        if stored is not None:
            return Decision("duplicate", update.round, update.client, stored)
        return Decision(ACCEPTED, update.round, update.client, digest)

    def receipt(self, decision: Decision) -> Receipt:
        """The signed receipt of a stored update (accepted, or a duplicate of one)."""
        assert decision.round is not None and decision.client is not None
        assert decision.digest is not None
        open_ = self.open_round
        assert open_ is not None  # an update is stored only once a round is heard
        current = decision.wire_version >= 3  # version 2 names no run but in its signature
        receipt = Receipt(
            fleet=self.fleet, round=decision.round, run=open_.run if current else "",
            client=decision.client, digest=decision.digest, wire_version=decision.wire_version,
        )  # fmt: skip
        if self.keys.signer is None:
            return receipt
        return sign(receipt, self.keys.signer, run=open_.run)

    def refusal(self, decision: Decision, payload: bytes | bytearray) -> Receipt | None:
        """The signed refusal of an update refused for good (``refused`` set:
        protocol/receipts.py), None before a round is heard (no run to name)."""
        assert decision.round is not None and decision.client is not None
        open_ = self.open_round
        if open_ is None:
            return None
        refusal = Receipt(
            fleet=self.fleet, round=decision.round, run=open_.run, client=decision.client,
            digest=payload_digest(payload), refused=decision.reason,
        )  # fmt: skip
        if self.keys.signer is None:
            return refusal
        return sign(refusal, self.keys.signer, run=open_.run)

    # -- partial sums -------------------------------------------------------------------

    def collect(
        self,
        *,
        run: str,
        round_: int,
        exclude: Iterable[str] = (),
        retract: Mapping[str, int] | None = None,
    ) -> PartialMessage:
        """This worker's partial of ``round_`` of ``run`` without the clients in
        ``exclude``, recomputed from its stored rows, with the summed statistics of the
        earlier copies ``retract`` names (client -> round) that it holds. From now on the
        round takes no more updates (it is recorded before the rows are read)."""
        self.store.mark_collected(run, round_)
        excluded = frozenset(exclude)
        copies: dict[str, Copy] = {}
        parts = [PartialSum.empty(num_classes=self.admission.num_classes, dim=self.admission.dim)]
        closed_form = self.admission.statistics
        statistics = [self._statistics_of([])] if closed_form else []
        chunk: list[PrototypeUpdate] = []

        def add(batch: list[PrototypeUpdate]) -> None:
            parts.append(self._partial_of(batch))
            if closed_form:
                statistics.append(self._statistics_of(batch))

        for row in self.store.updates(run, round_):
            if row.client in excluded:
                continue
            copies[row.client] = Copy(digest=row.digest, stored_at=row.stored_at)
            chunk.append(_decoded(row.payload))
            if len(chunk) == CHUNK:
                add(chunk)
                chunk = []
        if chunk:
            add(chunk)
        retract = dict(retract or {})
        return PartialMessage(
            fleet=self.fleet, run=run, round=round_, worker=self.name, partial=merge(parts),
            copies=copies, excluded=excluded,
            statistics=merge_parts(statistics) if closed_form else None,
            retract=retract, retraction=self._retraction(run, retract) if retract else None,
        )  # fmt: skip

    def _partial_of(self, updates: list[PrototypeUpdate]) -> PartialSum:
        return partial_of(updates, num_classes=self.admission.num_classes, dim=self.admission.dim)

    def _statistics_of(self, updates: Iterable[PrototypeUpdate]) -> StatisticsPart:
        return part_of(
            updates, num_classes=self.admission.num_classes, dim=self.admission.dim,
            gram=wire_method(self.admission.method).gram,
        )  # fmt: skip

    def _retraction(self, run: str, retract: Mapping[str, int]) -> StatisticsPart:
        """The statistics of the earlier copies named, as this worker stored them: one at
        a time (a client's replaced statistics are few). A copy it does not hold, or one
        without statistics, is left out; the owner sees which from the clients."""
        earlier = (self.store.update(run, r, client) for client, r in sorted(retract.items()))
        return self._statistics_of(_decoded(row.payload) for row in earlier if row is not None)


def _decoded(payload: bytes) -> PrototypeUpdate:
    """A stored update: it passed the checks when it came, so its own size is its cap."""
    return PrototypeUpdate.from_wire(payload, max_bytes=len(payload))


def _later(new: OpenRound, old: OpenRound) -> bool:
    """Whether ``new`` is ahead of ``old``: a later round of the same run, or a run that
    started later (the coordinator's database was replaced), as a device decides."""
    if new.run == old.run:
        return new.round > old.round
    return new.run_started > old.run_started
