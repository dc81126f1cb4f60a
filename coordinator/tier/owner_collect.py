"""A round's collect at the round owner (coordinator/tier/owner.py): every worker's first
answer, then what those answers call for from some workers (:class:`Ask`): their partial
without the clients another worker keeps (coordinator/tier/partial_wire.py::exclusions), and,
for a closed-form method, the earlier statistics of the clients whose new ones the round
counts (coordinator/tier/owner_statistics.py). :func:`plan` says what to ask; it is asked
again once those answers are in, until it asks nothing new (at most one more time: when a
worker no longer holds an earlier copy, the client's new statistics are left out)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from coordinator.tier.owner_statistics import OwnerStatistics
from coordinator.tier.partial_wire import CollectRequest, PartialMessage, exclusions


@dataclass(frozen=True)
class Ask:
    """What the second phase of a collect asks one worker for: its partial without the
    clients another worker keeps (``exclude``), with the earlier statistics of the
    clients whose new ones replace them (``retract``: client -> round)."""

    exclude: frozenset[str] = frozenset()
    retract: Mapping[str, int] = field(default_factory=dict)

    def answered_by(self, message: PartialMessage) -> bool:
        return message.excluded == self.exclude and dict(message.retract) == dict(self.retract)


@dataclass
class Collect:
    """One round's collect: every worker's first answer, then the answers to the asks
    (:class:`Ask`) the first answers call for, asked again every ``retry_s``."""

    round: int
    started: float
    first: dict[str, PartialMessage] = field(default_factory=dict)
    asks: dict[str, Ask] | None = None  # None until every first answer is in
    final: dict[str, PartialMessage] = field(default_factory=dict)
    answered_at: dict[str, float] = field(default_factory=dict)
    asked_at: float = -np.inf

    def waiting(self, members: Iterable[str]) -> list[str]:
        """The workers whose answer the current phase still lacks."""
        if self.asks is None:
            return [w for w in members if w not in self.first]
        return [w for w in self.asks if w not in self.final]

    def request(self, fleet: str, run: str, worker: str) -> CollectRequest:
        ask = Ask() if self.asks is None else self.asks[worker]
        return CollectRequest(fleet=fleet, run=run, round=self.round, worker=worker,
                              exclude=ask.exclude, retract=ask.retract)  # fmt: skip

    def ask(self, asks: dict[str, Ask]) -> list[str]:
        """Ask ``asks`` from now on: the workers whose ask changed, whose earlier answers
        no longer count."""
        changed = [w for w, a in asks.items() if self.asks is None or self.asks.get(w) != a]
        self.asks = asks
        self.final = {w: m for w, m in self.final.items() if w in asks and asks[w].answered_by(m)}
        self.asked_at = -np.inf
        return changed


def plan(
    collect: Collect, *, members: Collection[str], statistics: OwnerStatistics | None
) -> dict[str, Ask]:
    """What the first answers (and, for a closed-form method, the answers to the asks so
    far) call for: each client counted once (the exclusions), and the earlier statistics
    of the clients whose new ones the round counts taken back."""
    drop = {w: set(clients) for w, clients in exclusions(collect.first.values()).items()}
    retract: dict[str, dict[str, int]] = {}
    if statistics is not None:
        kept = {
            w: m.statistics.clients - drop.get(w, set())
            for w, m in collect.first.items()
            if m.statistics is not None
        }
        retract, lost = statistics.replacing(kept, members=members, answered=collect.final)
        for w, clients in lost.items():
            drop.setdefault(w, set()).update(clients)
    return {
        w: Ask(exclude=frozenset(drop.get(w, ())), retract=retract.get(w, {}))
        for w in sorted({*drop, *retract})
    }
