"""A secure fleet's delivery (``privacy.aggregation = "secure"``, edge_agent/delivery.py):
a round's release goes into the fleet's secure sum, never into an update.

- :class:`SecureSumInputs` (the agent's side, transport-free): lda and ridge add their
  statistics once per data version and coordinator run, and after new data only the
  difference from what the run's sum holds of them; FedProto adds each round's
  prototypes (rows of the classes held and a holder count each). The privacy mode admits the sum's noise against the budget when
  the round is joined, and charges the ledger just before the masked input leaves
  (:meth:`~edge_agent.privacy.modes.PrivacyMode.charge_secure_sum`): a round that aborts
  before costs nothing.
- edge_agent/secure_join.py (the MQTT service's side): runs the protocol for the round on
  a link of its own beside the service's loop, and settles it when a later announcement
  says the coordinator closed the round.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from edge_agent.closed_form import ClosedFormDevice
from edge_agent.delivery import Agent, Delivery, Sent
from edge_agent.secure_join import SecureInput, sum_view
from protocol import RoundAnnouncement
from secagg.fleet import (
    flatten,
    flatten_prototypes,
    prototype_release,
    secure_release,
    since_of,
)

log = logging.getLogger(__name__)


def _run(announcement: RoundAnnouncement) -> str:
    return announcement.auth.run if announcement.auth is not None else announcement.run


class SecureSumInputs(Delivery):
    """The agent's side of a secure fleet's rounds (module text)."""

    def prototypes(
        self, agent: Agent, announcement: RoundAnnouncement, *, z: np.ndarray,
        protos: np.ndarray, counts: np.ndarray,
    ) -> Sent:  # fmt: skip
        """No noise and no ledger entry: the claim is that the coordinator sees the sum
        only (a prototype's sensitivity to one example has no public bound here)."""
        round_ = announcement.round
        release = prototype_release(
            agent.cfg.secure_aggregation, dim=protos.shape[1], classes=agent.num_classes
        )
        secure = SecureInput(
            round=round_, run=_run(announcement), vector=flatten_prototypes(protos, counts > 0),
            settings=release.settings, version=f"round {round_}", statistics=None,
        )  # fmt: skip
        return Sent("secure", secure=secure, record={"secure": True}, published=True)

    def statistics(
        self, agent: Agent, announcement: RoundAnnouncement, *, closed: ClosedFormDevice,
        version: str,
    ) -> Sent | None:  # fmt: skip
        """Once per data version; paid for when the masked input leaves, so a round that
        aborts before costs nothing, and one after (the noised input is out) stays paid."""
        round_, run = announcement.round, _run(announcement)
        # A secure round's record has no announcement size: the protocol's traffic is
        # amended into it when the round settles (SecureJoin.settle).
        record: dict[str, Any] = {"bytes_down": None, "secure": True}
        extra = agent.state.snapshot.extra
        # Summed where: a coordinator of another run (its database lost or replaced), or a
        # sum started again (behind the devices), holds none of this device's statistics.
        since = since_of(announcement.extras)
        in_sum = sum_view(agent.state, run=run, since=since)[0] >= 0
        if in_sum and extra.get("statistics_summed") == version:
            log.info("round %d: statistics of this data already in the fleet's sum", round_)
            return Sent("nothing_new", record=record | {"statistics_sent": False},
                        published=True)  # fmt: skip
        release = secure_release(
            agent.cfg.secure_aggregation, k=closed.dim, classes=agent.num_classes,
            gram=agent.record.wire.gram,
            basis=closed.basis if agent.cfg.closed_form.basis else None,
        )  # fmt: skip
        if not agent.mode.admit_secure_sum(round_, release.plan):
            return None
        statistics = flatten(closed.statistics(), gram=release.gram)
        # The fleet's sum is a running one: new data adds its difference from the data
        # summed before (the same sensitivity to one example as the statistics).
        held = agent.state.load_summed(statistics.size) if in_sum else 0.0
        vector = statistics - held
        plan, mode = release.plan, agent.mode
        secure = SecureInput(round=round_, run=run, vector=vector,
                             settings=release.settings, version=version,
                             statistics=statistics, since=since,
                             release=lambda: mode.charge_secure_sum(round_, plan))  # fmt: skip
        return Sent("secure", secure=secure, record=record | {"statistics_sent": True},
                    published=True)  # fmt: skip
