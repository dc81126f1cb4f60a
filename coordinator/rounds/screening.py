"""Every check an update passes before it counts: the fleet's admission checks
(:mod:`coordinator.admission`) and, unless the fleet runs insecure, its enrolled device's
signature for this run. Applied on arrival, and again to a stored round when it resumes."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from coordinator.admission import Admission
from coordinator.keys import CoordinatorKeys
from coordinator.metrics import Metrics
from coordinator.storage.store import Store
from protocol import ProtocolError, PrototypeUpdate

log = logging.getLogger(__name__)


class Screening:
    def __init__(self, *, admission: Admission, keys: CoordinatorKeys, run_id: str) -> None:
        self.admission = admission
        self.keys = keys
        self.run_id = run_id

    def problem(self, update: PrototypeUpdate, *, topic_client: str | None = None) -> str | None:
        """Why ``update`` may not be stored, or None if it may."""
        return self.admission.check(update, topic_client=topic_client) or self.forged(update)

    def forged(self, update: PrototypeUpdate) -> str | None:
        """Why ``update`` is not signed by its enrolled device for this run, if it is not."""
        if self.keys.insecure:
            return None
        return self.keys.signature_problem(update, run=self.run_id)

    def failing(
        self, stored: Iterable[tuple[str, bytes]], *, round_: int
    ) -> Iterator[tuple[str, str]]:
        """(client, reason) for each of round ``round_``'s stored ``(client, payload)``
        that today's checks refuse: admitted by an older version or another configuration
        (a reload that lowered ``admission.max_count``, say)."""
        for client, payload in stored:
            try:
                update = PrototypeUpdate.from_wire(payload, max_bytes=len(payload))
            except ProtocolError as exc:
                reason: str | None = exc.reason
            else:
                reason = self.problem(update)
                if reason is None and update.round != round_:
                    reason = "wrong_round"
            if reason is not None:
                yield client, reason

    def quarantine_failing(self, store: Store, metrics: Metrics, round_: int) -> None:
        """Set aside the stored updates of round ``round_`` that today's checks refuse
        (:meth:`failing`): aggregating them could fail at every restart, so they leave the
        round, counted, and the service keeps serving."""
        for client, reason in self.failing(store.updates(round_), round_=round_):
            store.quarantine(round_, client, reason)
            metrics.updates_quarantined.inc()
            quarantined(round_, client, reason)


def quarantined(round_: int, client: str, reason: str, *, worker: str = "") -> None:
    """Say that a stored update left its round (``worker``: the worker that held it)."""
    log.warning(
        "round %d: the stored update of %s%s fails today's checks (%s); quarantined",
        round_, client, f" on worker {worker}" if worker else "", reason,
        extra={"event": "update_quarantined", "round": round_, "client": client,
               "reason": reason},
    )  # fmt: skip
