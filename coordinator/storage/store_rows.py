"""What the coordinator's store (coordinator/storage/store.py) reads and writes besides its
tables: a round's row, one close's :class:`Commit`, and the errors an operator is told of
(a state directory of another fleet, a disk that cannot be written, a damaged file)."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runtime.cliutil import CommandFailed


class StateError(RuntimeError):
    """The state directory belongs to another fleet or is unreadable."""


class StorageFault(CommandFailed):
    """The database cannot be written (a full disk, an I/O error). The coordinator stops
    taking updates and exits non-zero; systemd restarts it, and an update it had not yet
    stored was never acknowledged, so the broker delivers it again."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        if corrupt(cause):
            # Restarting onto the same pages would fail the same way: say so.
            super().__init__(
                f"storage error: {cause}; the database is damaged and the coordinator stopped "
                "taking updates; a restart checks it and says what to do"
            )
            return
        super().__init__(
            f"storage error: {cause}; stopped taking updates (an unstored update is "
            "delivered again after the restart)"
        )


def corrupt(exc: BaseException) -> bool:
    """An SQLite error that means damaged pages rather than a full or failing disk."""
    text = str(exc).lower()
    return isinstance(exc, sqlite3.DatabaseError) and (
        "malformed" in text or "not a database" in text or "corrupt" in text
    )


def damaged_message(path: Path, exc: BaseException) -> str:
    return (
        f"coordinator database {path} is damaged ({exc}); it was not changed. Stop here: move "
        "it aside with its -wal and -shm files and restore a copy taken with SQLite's backup "
        "(docs/deploy.md, section 4)"
    )


@dataclass(frozen=True)
class RoundRow:
    round: int
    opened_at: float
    deadline: float
    closed_at: float | None
    announcement: bytes
    extensions: int = 0


@dataclass(frozen=True)
class Commit:
    """One round's close, written in one transaction (:meth:`Store.advance`): round
    ``closed`` is closed and ``opens`` (by default ``closed + 1``; later when a rolled-back
    database skips the rounds its devices already answered) opened with ``announcement``.

    ``final``: the opened round is stored closed as well, so a crash cannot leave the last
    round open and a restart take updates past it. ``keep_rounds`` > 0: the payloads
    (updates and announcement) of rounds older than the last ``keep_rounds`` closed ones
    are dropped in the same transaction, their timing rows kept; a service that runs for
    months would otherwise keep every update it ever received (100 FedPCL devices add
    1.6 MB a round, a FedAvg fleet about 95 MB).

    ``statistics``: the clients whose closed-form updates of the round carried class
    statistics: each update is copied to the statistics table, replacing that client's
    previous one, and outlives ``keep_rounds`` (the fleet's head is solved from every
    client's latest, :meth:`Store.statistics_of`). ``meta``: values set in the meta table
    (a secure fleet's running sum, :meth:`Store.meta_value`)."""

    closed: int
    closed_at: float
    announcement: bytes
    deadline: float
    keep_rounds: int = 0
    final: bool = False
    statistics: Sequence[str] = ()
    next_round: int | None = None
    meta: Mapping[str, str] = field(default_factory=dict)

    @property
    def opens(self) -> int:
        return self.closed + 1 if self.next_round is None else self.next_round
