"""The privacy ledger: every spend of an agent's budget, durable before anything leaves.

``privacy.json`` in the agent's state directory holds the budget and the list of
events per round. It is rewritten atomically (temp file, fsync, rename, directory fsync)
*before* the update that the events pay for is stored or published, so a crash can only
make the ledger count a release that never left the device (conservative), never forget
one that did. Entries are only ever appended; the spent epsilon never goes down.

A spend made with reproducible noise (``privacy.reproducible_noise_seed``) is marked so;
one such spend voids the guarantee of the whole ledger, whose ``guarantee`` then says
``none (reproducible noise)`` for good.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.privacy.accounting import Event, epsilon
from edge_agent.privacy.randomness import DP_GUARANTEE, REPRODUCIBLE
from runtime.files import atomic_write


@dataclass(frozen=True)
class Spend:
    round: int
    events: tuple[Event, ...]
    reproducible: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "events": [e.to_json() for e in self.events],
            "guarantee": REPRODUCIBLE if self.reproducible else DP_GUARANTEE,
        }


class LedgerError(ValueError):
    """An unreadable or inconsistent ledger: the agent refuses to run rather than guess."""


class Ledger:
    FILE = "privacy.json"

    def __init__(
        self, state_dir: Path, *, epsilon_budget: float, delta: float, accountant: str
    ) -> None:
        self.path = state_dir / self.FILE
        self.budget = epsilon_budget
        self.delta = delta
        self.accountant = accountant
        self.spends: list[Spend] = []
        #: Held while spends are read or appended: a secure fleet's round is charged on
        #: its protocol's thread (edge_agent/privacy/modes.py), beside the service's.
        self.lock = threading.RLock()
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            self.spends = [
                Spend(
                    int(s["round"]),
                    tuple(Event.from_json(e) for e in s["events"]),
                    reproducible=s.get("guarantee", DP_GUARANTEE) != DP_GUARANTEE,
                )
                for s in data["spends"]
            ]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LedgerError(f"privacy ledger {self.path} is unreadable: {exc}") from exc
        if data.get("delta") != self.delta or data.get("accountant") != self.accountant:
            # Changing delta or the accountant mid-life would re-price the past: refuse.
            raise LedgerError(
                f"privacy ledger {self.path} was kept with delta {data.get('delta')} and "
                f"accountant {data.get('accountant')}; the configuration says {self.delta} "
                f"and {self.accountant}. Keep them, or start a new state directory."
            )

    @property
    def guarantee(self) -> str:
        """What the ledger's spends claim together: nothing once any used replayable noise."""
        return REPRODUCIBLE if any(s.reproducible for s in self.spends) else DP_GUARANTEE

    @property
    def history(self) -> list[Event]:
        return [e for s in self.spends for e in s.events]

    def spent(self, extra: list[Event] | None = None) -> float:
        with self.lock:
            history = self.history
        return epsilon(history + list(extra or []), delta=self.delta, accountant=self.accountant)

    def allows(self, events: list[Event]) -> bool:
        """Whether spending ``events`` keeps the total within the budget."""
        return self.spent(events) <= self.budget + 1e-9

    def record(self, round_: int, events: list[Event], *, reproducible: bool = False) -> float:
        """Append and make durable; returns the epsilon spent including these events."""
        with self.lock:
            return self._record(round_, events, reproducible=reproducible)

    def _record(self, round_: int, events: list[Event], *, reproducible: bool) -> float:
        self.spends.append(Spend(round_, tuple(events), reproducible))
        total = self.spent()
        document: dict[str, Any] = {
            "budget_epsilon": self.budget,
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon_spent": total,
            "guarantee": self.guarantee,
            "spends": [s.to_json() for s in self.spends],
        }
        atomic_write(self.path, json.dumps(document, indent=1).encode())
        return total
