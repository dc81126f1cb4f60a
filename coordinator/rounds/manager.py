"""The single coordinator's rounds: the round cycle (coordinator/rounds/cycle.py) with the
updates taken in and stored here. Transport-free, so it is driven the same way by the MQTT
service, an in-memory fleet and the tests.

An update goes ``offer`` -> :mod:`protocol` decode -> :mod:`coordinator.rounds.screening` ->
``Store.add_update``, and its receipt names the stored bytes' digest. The round's result
comes from the tally the method and the fleet's privacy settings call for
(:meth:`RoundManager._make_tally`): the strategy over the stored updates, the running sum
of closed-form statistics, or the secure sum."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from coordinator.config import CoordinatorConfig
from coordinator.decision import ACCEPTED, Decision
from coordinator.metrics import Metrics
from coordinator.rounds.cycle import RoundCycle
from coordinator.rounds.secure import FleetSum, SecureOutcome, SecureSum
from coordinator.rounds.statistics import FleetStatistics
from coordinator.rounds.stored import RunningStatistics, StoredUpdates
from coordinator.rounds.tally import Tally
from coordinator.storage.store import RoundRow, Store
from coordinator.strategies import Strategy, make_strategy
from coordinator.strategies.closed_form import ClosedForm
from protocol import ProtocolError, PrototypeUpdate, RoundAnnouncement
from protocol.limits import PROTOCOL_VERSION
from protocol.methods import wire_method
from protocol.receipts import payload_digest
from secagg.fleet import SecureRelease, prototype_release, secure_release

log = logging.getLogger(__name__)


class RoundManager(RoundCycle):
    """Owns the open round (coordinator/rounds/cycle.py) and takes the devices' updates.

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
        self.strategy = strategy or make_strategy(
            config.model.method, robust=config.robust, **dict(config.model.strategy)
        )
        #: A secure fleet's (privacy.aggregation = "secure") public settings: each round
        #: closes with its secure-aggregation round (coordinator/rounds/secure_rounds.py runs it).
        self.secure: SecureRelease | None = None
        super().__init__(config=config, store=store, metrics=metrics, clock=clock)

    def _make_tally(self, latest: RoundRow, *, resumed: bool) -> Tally:
        config, model = self.config, self.config.model
        wire = wire_method(model.method)
        if config.secure:
            self.secure = (
                secure_release(
                    config.secure_aggregation, k=model.dim, classes=len(model.classes),
                    gram=wire.gram, devices=len(self.keys.devices) or None,
                    basis=config.closed_form.basis_check(
                        fleet=config.fleet, feature_dim=model.feature_dim, dim=model.dim
                    ),
                )
                if wire.closed_form
                # FedProto: each round's global prototypes from that round's summed rows.
                else prototype_release(
                    config.secure_aggregation, dim=model.dim, classes=len(model.classes)
                )
            )  # fmt: skip
            return SecureSum(release=self.secure, store=self.store, strategy=self.strategy)
        if wire.closed_form:
            assert isinstance(self.strategy, ClosedForm)  # the method's record says it is
            return RunningStatistics(
                store=self.store,
                statistics=FleetStatistics(
                    store=self.store, strategy=self.strategy, num_classes=len(model.classes),
                    dim=model.dim, gram=wire.gram,
                    # Today's checks, signature included: a client unenrolled or revoked
                    # since (a reload or restart) is left out of the sum.
                    admissible=lambda u: self.screening.problem(u),
                    count_cap=config.closed_form.count_cap,
                ),
            )  # fmt: skip
        return StoredUpdates(
            store=self.store, strategy=self.strategy, num_classes=len(model.classes),
            dim=model.dim, read=self._stored_update,
        )  # fmt: skip

    # -- updates -----------------------------------------------------------------------

    def offer(self, payload: bytes | bytearray, *, topic_client: str | None = None) -> Decision:
        """Validate and store one update payload, counting the outcome."""
        decision = self._judge(payload, topic_client)
        if decision.accepted:
            self.metrics.updates_accepted.inc()
            assert decision.client is not None and decision.round is not None
            self.metrics.client_last_accepted.labels(client=decision.client).set(decision.round)
            if decision.epsilon is not None:
                self.metrics.client_epsilon_spent.labels(client=decision.client).set(
                    decision.epsilon
                )
        else:
            self.rejections.reject_update(
                decision.reason, round_=decision.round, client=decision.client or topic_client
            )
        return decision

    def _judge(self, payload: bytes | bytearray, topic_client: str | None) -> Decision:
        try:
            update = PrototypeUpdate.from_wire(
                payload, max_bytes=self.config.mqtt.max_payload_bytes
            )
        except ProtocolError as exc:
            return Decision(exc.reason)
        if update.wire_version < PROTOCOL_VERSION and self.config.protocol.previous_refused(
            self._clock()
        ):
            return Decision("version", update.round, update.client)
        decision = self._judge_update(update, payload, topic_client)
        return dataclasses.replace(decision, wire_version=update.wire_version)

    def _judge_update(
        self, update: PrototypeUpdate, payload: bytes | bytearray, topic_client: str | None
    ) -> Decision:
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
            self.tally.take(update)
            self.presence.know(update.client)
            open_.arrivals.append(now)
        return Decision(
            ACCEPTED, update.round, update.client, digest, epsilon=update.privacy.epsilon
        )

    def _stored(self, update: PrototypeUpdate, payload: bytes | bytearray) -> str | None:
        """``update``, received as ``payload``, is now stored in the open round (called
        under the lock): the digest its receipt names."""
        return payload_digest(payload)

    def _stored_update(self, client: str) -> PrototypeUpdate:
        """The update the store holds for ``client`` in the open round, decoded."""
        payload = self.store.update_payload(self._open.number, client)
        return PrototypeUpdate.from_wire(payload, max_bytes=1 << 62)

    def secure_sum(self) -> FleetSum | None:
        """The fleet's secure running sum (what it holds of each device, the round it
        began), or None where there is none (FedProto's rounds)."""
        tally = self.tally
        return tally.sum if isinstance(tally, SecureSum) else None

    def take_secure(self, outcome: SecureOutcome) -> bool:
        """The open round's secure aggregation has ended (coordinator/rounds/secure_rounds.py):
        :meth:`poll` closes the round with it. False for another round's (a late one)."""
        with self._lock:
            if self._done or not isinstance(self.tally, SecureSum):
                return False
            return self.tally.offer(outcome, open_round=self._open.number)

    def poll(self) -> RoundAnnouncement | None:
        """Close the round if it is due; return the new announcement to publish, if any."""
        sent = self._turn()  # this driver's tallies send nothing but announcements
        return sent[-1] if sent else None
