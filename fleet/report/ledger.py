"""Whether a finished run's coordinator stored every update of every round exactly once.

Read from the coordinator's database, not from the agents' records: an agent that
believes it answered proves nothing about what the coordinator kept (a broker queue that
overflows drops updates it had acknowledged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.storage.store_reader import StoreReader
from fleet.transports.collect import run_database
from fleet.transports.spec import RunSpec


@dataclass(frozen=True)
class UpdateLedger:
    """What the database holds of ``clients x rounds`` expected updates."""

    expected: int
    stored: int  # distinct expected (round, client) pairs held
    missing: tuple[tuple[int, str], ...]  # expected pairs not held, in order
    # Rows beyond the first for one (round, client): the primary key allows none, so any
    # is a broken schema, counted apart from the losses.
    duplicates: int
    unexpected: int  # pairs held for a client or round not expected
    pruned: tuple[int, ...]  # rounds whose payloads keep_rounds dropped: not checked
    # Accepted updates by the clients' tallies minus rows held, when no round is pruned:
    # above 0, an update was counted twice (or quarantined since).
    tally_gap: int

    @property
    def lost(self) -> int:
        return self.expected - self.stored

    @property
    def exact(self) -> bool:
        """Every expected update stored once, and nothing else."""
        return not (self.lost or self.duplicates or self.unexpected or self.tally_gap)


def update_ledger(database: Path, *, clients: Sequence[str], rounds: int) -> UpdateLedger:
    """Check the updates of rounds ``0 .. rounds-1`` from every one of ``clients``."""
    with StoreReader(database) as store:
        copies = store.update_copies(before=rounds)
        pruned = tuple(store.pruned_rounds(before=rounds))
        tally = store.accepted_tally()
        held_total = store.update_count()
    names = set(clients)
    checked = [r for r in range(rounds) if r not in pruned]
    missing = tuple((r, c) for r in checked for c in sorted(names) if (r, c) not in copies)
    expected = len(names) * len(checked)
    return UpdateLedger(
        expected=expected,
        stored=expected - len(missing),
        missing=missing,
        duplicates=sum(n - 1 for n in copies.values()),
        unexpected=sum(1 for _, c in copies if c not in names),
        pruned=pruned,
        tally_gap=0 if pruned else tally - held_total,
    )


def run_ledger(spec: RunSpec, clients: Sequence[str]) -> UpdateLedger:
    """The ledger of a finished fleet run (every client answers every round)."""
    return update_ledger(run_database(spec), clients=clients, rounds=spec.rounds)
