"""Read-only access to a coordinator database, for what reads a finished run."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from coordinator.storage.store import StateError


class StoreReader:
    """Read-only access to a database a coordinator wrote (a finished simulated run, a
    benchmark's): opened with ``mode=ro``, so reading never migrates, checkpoints or
    otherwise changes it, and works on read-only files."""

    def __init__(self, path: Path) -> None:
        try:
            self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        except sqlite3.DatabaseError as exc:
            raise StateError(f"cannot read coordinator database {path}: {exc}") from exc
        self.path = path

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._db.close()

    def round_times(self, *, before: int) -> list[tuple[int, float, float | None]]:
        """``(round, opened_at, closed_at)`` of every round below ``before``, in order."""
        rows = self._db.execute(
            "SELECT round, opened_at, closed_at FROM rounds WHERE round < ? ORDER BY round",
            (before,),
        ).fetchall()
        return [(int(r), float(o), None if c is None else float(c)) for r, o, c in rows]

    def update_count(self) -> int:
        """Updates stored, over every round."""
        return int(self._db.execute("SELECT COUNT(*) FROM updates").fetchone()[0])

    def update_copies(self, *, before: int) -> dict[tuple[int, str], int]:
        """Rows held in the updates table for each ``(round, client)`` below ``before``.
        The primary key allows one; the rows are counted, not assumed, so a checker that
        reads this would see a schema that lost its key."""
        rows = self._db.execute(
            "SELECT round, client, COUNT(*) FROM updates WHERE round < ? GROUP BY round, client",
            (before,),
        ).fetchall()
        return {(int(r), str(c)): int(n) for r, c, n in rows}

    def pruned_rounds(self, *, before: int) -> list[int]:
        """Rounds below ``before`` whose payloads ``keep_rounds`` has dropped (their
        announcement is emptied in the same transaction as their updates are deleted)."""
        rows = self._db.execute(
            "SELECT round FROM rounds WHERE round < ? AND length(announcement) = 0 ORDER BY round",
            (before,),
        ).fetchall()
        return [int(r) for (r,) in rows]

    def accepted_tally(self) -> int:
        """Updates ever accepted, by the clients' running tallies (which outlive the
        payloads ``keep_rounds`` drops and count each (round, client) once)."""
        return int(
            self._db.execute("SELECT COALESCE(SUM(updates), 0) FROM contributions").fetchone()[0]
        )
