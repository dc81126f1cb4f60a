"""The privacy ledger: every spend of an agent's budget, durable before anything leaves.

``privacy.json`` in the agent's state directory holds the budget and the list of
events per round. It is rewritten atomically (temp file, fsync, rename, directory fsync)
*before* the update that the events pay for is stored or published, so a crash can only
make the ledger count a release that never left the device (conservative), never forget
one that did. Entries are only ever appended; the spent epsilon never goes down.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.privacy.accounting import Event, epsilon
from protocol.files import atomic_write


@dataclass(frozen=True)
class Spend:
    round: int
    events: tuple[Event, ...]


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
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            self.spends = [
                Spend(int(s["round"]), tuple(Event.from_json(e) for e in s["events"]))
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
    def history(self) -> list[Event]:
        return [e for s in self.spends for e in s.events]

    def spent(self, extra: list[Event] | None = None) -> float:
        return epsilon(
            self.history + list(extra or []), delta=self.delta, accountant=self.accountant
        )

    def allows(self, events: list[Event]) -> bool:
        """Whether spending ``events`` keeps the total within the budget."""
        return self.spent(events) <= self.budget + 1e-9

    def record(self, round_: int, events: list[Event]) -> float:
        """Append and make durable; returns the epsilon spent including these events."""
        self.spends.append(Spend(round_, tuple(events)))
        total = self.spent()
        document: dict[str, Any] = {
            "budget_epsilon": self.budget,
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon_spent": total,
            "spends": [
                {"round": s.round, "events": [e.to_json() for e in s.events]} for s in self.spends
            ],
        }
        atomic_write(self.path, json.dumps(document, indent=1).encode())
        return total
