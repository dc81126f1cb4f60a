"""How a round's release leaves the device, chosen once at start (as Flower's
``secaggplus_mod`` wraps a client's fit instead of a second client): a signed update on the
update topic (:class:`SignedUpdates`), or an input to the fleet's secure sum
(edge_agent/secure_delivery.py, ``privacy.aggregation = "secure"``).

The agent (edge_agent/agent.py) trains, computes the round's prototypes or takes its
statistics, and hands them to the delivery; the delivery makes the release through the
privacy mode (which prices every release against the ledger, the secure sum's included)
and says what was sent (:class:`Sent`); the agent then writes the round's record, in one
place, from what was sent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from edge_agent.closed_form import ClosedFormDevice, StatisticsRelease
from edge_agent.config import AgentConfig
from edge_agent.extras import update_extras
from edge_agent.keys import AgentKeys
from edge_agent.methods import DeviceMethod
from edge_agent.privacy.modes import PrivacyMode
from edge_agent.secure_join import SecureInput
from edge_agent.state import StateDir
from edge_agent.train import LocalModel
from protocol import PrototypeUpdate, RoundAnnouncement


class Agent(Protocol):
    """What a delivery reads of the agent (edge_agent/agent.py::Agent)."""

    cfg: AgentConfig
    mode: PrivacyMode
    model: LocalModel
    keys: AgentKeys
    state: StateDir
    record: DeviceMethod
    train_labels: np.ndarray
    num_classes: int
    bundle_id: str


@dataclass(frozen=True)
class Sent:
    """What a round's delivery did: the agent's answer (``reason``, and the signed
    ``update`` and its ``payload``, or a secure sum's ``secure`` input), and what the
    round's record adds (``record``)."""

    reason: str
    update: PrototypeUpdate | None = None
    payload: bytes = b""
    secure: SecureInput | None = None
    record: dict[str, Any] = field(default_factory=dict)
    #: Answered with nothing on the update topic: no receipt will come.
    published: bool = False


class Delivery(ABC):
    """How a round's release leaves the device (module text)."""

    @abstractmethod
    def prototypes(
        self, agent: Agent, announcement: RoundAnnouncement, *, z: np.ndarray,
        protos: np.ndarray, counts: np.ndarray,
    ) -> Sent:  # fmt: skip
        """A trained round's release: ``z`` (N, d) the embeddings of the training data,
        ``protos`` (C, d) and ``counts`` (C,) their exact prototypes."""

    @abstractmethod
    def statistics(
        self, agent: Agent, announcement: RoundAnnouncement, *, closed: ClosedFormDevice,
        version: str,
    ) -> Sent | None:  # fmt: skip
        """A closed-form round's release of the statistics of data ``version``; None when
        the budget refuses it."""


class SignedUpdates(Delivery):
    """An update on the update topic, signed for the announcement's run, sent again until
    the coordinator's receipt names it."""

    def prototypes(
        self, agent: Agent, announcement: RoundAnnouncement, *, z: np.ndarray,
        protos: np.ndarray, counts: np.ndarray,
    ) -> Sent:  # fmt: skip
        cfg, mode, round_ = agent.cfg, agent.mode, announcement.round
        release, spent = mode.release(round_, z, agent.train_labels)
        extras = update_extras(
            method=cfg.method, model=agent.model, held=np.flatnonzero(counts > 0), z=z,
            labels=agent.train_labels, num_classes=agent.num_classes,
        )  # fmt: skip
        return self.signed(agent, announcement, PrototypeUpdate(
            fleet=cfg.fleet, round=round_, client=cfg.agent_id, bundle=agent.bundle_id,
            method=cfg.method, classes=tuple(int(c) for c in release.classes),
            counts=mode.wire_counts(release.counts),
            prototypes=release.prototypes.astype(np.float16), extras=extras,
            privacy=mode.meta(spent),
        ))  # fmt: skip

    def statistics(
        self, agent: Agent, announcement: RoundAnnouncement, *, closed: ClosedFormDevice,
        version: str,
    ) -> Sent | None:  # fmt: skip
        """The statistics until the coordinator has stored them for this data version (a
        receipt says so, :meth:`Agent.confirmed`), an update with no rows after that, so
        a run costs the statistics once and a few hundred bytes a round."""
        cfg, mode, round_ = agent.cfg, agent.mode, announcement.round
        # Stored where: a coordinator of another run (its database lost or moved aside)
        # holds none of them, nor one that holds them in the basis of an earlier
        # projection. ``version`` alone keys the release (a noisy one is made once).
        stored_as = f"{version}@{announcement.run}/{closed.projection_name}"
        sent = agent.state.snapshot.extra.get("statistics_stored") == stored_as
        made = (
            (StatisticsRelease.nothing(closed.dim), mode.spent())
            if sent
            else mode.release_statistics(round_, version=version, closed=closed)
        )
        if made is None:
            return None
        release, spent = made
        out = self.signed(agent, announcement, release.update(
            fleet=cfg.fleet, round_=round_, client=cfg.agent_id, bundle=agent.bundle_id,
            method=cfg.method, privacy=mode.meta(spent),
        ))  # fmt: skip
        if not sent:
            agent.state.record(statistics_sent={"round": round_, "version": stored_as})
        out.record["statistics_sent"] = not sent
        return out

    @staticmethod
    def signed(agent: Agent, announcement: RoundAnnouncement, update: PrototypeUpdate) -> Sent:
        run = announcement.auth.run if announcement.auth is not None else None
        # Answered in the announcement's version, which its coordinator reads.
        update = replace(update, wire_version=announcement.wire_version)
        update = agent.keys.sign(update, run=run)
        return Sent("answered", update=update, payload=update.to_wire())
