"""The open round as the round manager holds it in memory: its deadline and extensions,
when updates arrived and which clients sent them, and when the round is due to close.

Rebuilt from the store on a restart (coordinator/rounds/cycle.py), so deciding whether the round
is due costs O(1) per update instead of a query over the whole round."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.config import RoundSettings


@dataclass
class OpenRound:
    number: int
    opened_at: float
    deadline: float
    extensions: int = 0
    #: When each stored update arrived, in arrival order.
    arrivals: list[float] = field(default_factory=list)
    #: The stored updates' digests by client, what their receipts name (None: none was
    #: computed); its keys are the clients that have answered.
    digests: dict[str, str | None] = field(default_factory=dict)

    def close_time(self, rounds: RoundSettings) -> float | None:
        """When the round may close, or None while it cannot (too few updates)."""
        arrivals = self.arrivals
        if len(arrivals) < rounds.min_clients:
            return None
        allow = rounds.allow_list
        if allow and set(allow) <= self.digests.keys():
            return arrivals[-1]  # everyone expected has answered
        return min(arrivals[rounds.min_clients - 1] + rounds.wait_after_quorum_s, self.deadline)

    def extend(self, *, now: float, timeout_s: float) -> None:
        """The deadline passed short of a quorum: wait ``timeout_s`` more."""
        self.deadline = now + timeout_s
        self.extensions += 1
