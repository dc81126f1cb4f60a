"""What the devices' statuses say of the coordinator's run.

Each device's retained status names the run it follows and the last round it answered in
it. A coordinator whose database was rolled back (a write-ahead log cut by a crash, a
restored backup) finds devices past its open round in its own run: they would refuse every
round up to theirs as already answered, so the round manager opens the round after
theirs. One whose database was lost finds devices on another run: it says so, and they
adopt its run when they hear it, since it started later than theirs.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from coordinator.rounds.open_round import OpenRound
from protocol import Status

log = logging.getLogger(__name__)

#: From this many devices reporting on the run, the highest report alone moves nothing:
#: the round to skip past is the second highest, so one device that lies about how far it
#: got cannot send the fleet past every honest device's plausible next round.
TRUST_SECOND_FROM = 3


class RunReports:
    """The last round each device says it answered in run ``run``, and the devices on
    other runs (said once per run in the log). Kept as a count of devices per round, so
    that the round manager may ask after every update at 10,000 devices: the distinct
    rounds reported are a handful."""

    def __init__(self, *, run: str, path: Path) -> None:
        self.run = run
        self.path = path
        self._answered: dict[str, int] = {}
        self._per_round: Counter[int] = Counter()
        self._elsewhere: dict[str, str] = {}
        self._said: set[str] = set()

    @property
    def elsewhere(self) -> dict[str, str]:
        """Devices that follow another run than this coordinator's, and that run."""
        return dict(self._elsewhere)

    def _set(self, client: str, round_: int | None) -> None:
        old = self._answered.pop(client, None)
        if old is not None:
            self._per_round[old] -= 1
            if not self._per_round[old]:
                del self._per_round[old]
        if round_ is not None:
            self._answered[client] = round_
            self._per_round[round_] += 1

    def record(self, status: Status) -> None:
        client = status.client
        if status.run == self.run:
            self._elsewhere.pop(client, None)
            if status.last_round is not None:
                self._set(client, status.last_round)
            return
        self._set(client, None)
        if not status.run:
            self._elsewhere.pop(client, None)  # follows none yet
            return
        self._elsewhere[client] = status.run
        if status.run not in self._said:
            self._said.add(status.run)
            log.warning(
                "client %s follows run %s, which %s does not hold (this coordinator's run is "
                "%s): the database was lost or replaced. Devices adopt this run when they "
                "hear it if it started later than theirs; one restored from an older run "
                "they refuse (docs/deploy.md, 'A lost or rolled-back database')",
                client, status.run, self.path, self.run,
                extra={"event": "other_run", "run": status.run},
            )  # fmt: skip

    def _highest(self) -> int | None:
        """The highest round reported, or the second highest (counting devices) from
        :data:`TRUST_SECOND_FROM` reporting devices on."""
        if not self._answered:
            return None
        rank = 2 if len(self._answered) >= TRUST_SECOND_FROM else 1
        for round_ in sorted(self._per_round, reverse=True):
            rank -= self._per_round[round_]
            if rank <= 0:
                return round_
        raise AssertionError("the counts add up to the devices")  # pragma: no cover

    def answered_past(self, open_: OpenRound, *, deadline_passed: bool) -> int | None:
        """The round the devices have answered past the open one, if they have: the open
        round must then be skipped to the round after it. Also the open round itself once
        its deadline passed with nothing stored while devices say they answered it (its
        updates were lost with the database)."""
        highest = self._highest()
        if highest is None:
            return None
        if highest > open_.number:
            return highest
        if highest == open_.number and deadline_passed and not open_.arrivals:
            return highest
        return None
