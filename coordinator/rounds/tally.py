"""What varies between a coordinator's rounds: where a round's result comes from.

The round's life (open, intake, the clock and its extensions, deciding when it is due, the
close transaction, the announcement, resume and run identity) is held once, by
:class:`coordinator.rounds.cycle.RoundCycle`. Its result comes from a plugged-in
:class:`Tally`, as Flower plugs ``SecAggPlusWorkflow`` into its ``DefaultWorkflow``'s fit
stage instead of writing a second driver:

- stored updates through the method's strategy (coordinator/rounds/stored.py);
- the running sum of the closed-form statistics (coordinator/rounds/stored.py);
- the secure sum, of statistics or of FedProto's prototypes (coordinator/rounds/secure.py);
- the workers' partial sums (coordinator/tier/owner_partials.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coordinator.strategies import Aggregate

if TYPE_CHECKING:
    import numpy as np

    from coordinator.rounds.open_round import OpenRound
    from protocol import PrototypeUpdate, RoundAnnouncement


@dataclass(frozen=True)
class Tallied:
    """What a tally made of the round it closes: the ``aggregate`` to announce, and what
    the close's transaction writes beside it (coordinator/storage/store.py::Commit)."""

    aggregate: Aggregate
    #: The updates the round closed with, and where they came from (the close's log line).
    updates: int = 0
    source: str = ""
    #: Warn when the round closes with fewer updates than ``rounds.min_clients``.
    counted: bool = True
    statistics: Sequence[str] = ()
    meta: Mapping[str, str] = field(default_factory=dict)
    #: Whatever the tally needs back in :meth:`Tally.committed`.
    detail: Any = None
    #: Why the round's own head was refused and the last good one announced again
    #: (coordinator/rounds/head_guard.py); empty when it was not.
    kept: str = ""


class Tally(ABC):
    """Where a round's result comes from (module text). The cycle calls it under its lock."""

    #: Closed by an outcome of its own (a secure round, with its own stage deadlines), not
    #: by counting updates: :meth:`ready` says when.
    closes_itself: bool = False
    #: The open round's update count was lost (a restarted round owner): the round is
    #: due at its deadline whatever the count says, and the tally decides.
    count_unknown: bool = False
    #: :meth:`take` wants the open round's stored updates (decoded again at a resume).
    takes_updates: bool = False

    def take(self, update: PrototypeUpdate) -> None:  # noqa: B027 - most tallies read the store
        """An update of the open round was stored."""

    def ready(self) -> bool:
        """A tally that :attr:`closes_itself`: its outcome is in."""
        return False

    def wait_s(self, now: float) -> float | None:
        """While a close is under way (:meth:`tally` returned messages): how long until
        it needs to be asked again; None when no close is under way."""
        return None

    @abstractmethod
    def tally(
        self, closing: OpenRound, *, now: float, last: RoundAnnouncement
    ) -> Tallied | list[Any]:
        """The result of round ``closing``, or the messages to send before it can be had
        (the cycle asks again after them); ``last`` is the announcement now held."""

    def skipped(self) -> Sequence[str]:
        """The open round is skipped (a rolled-back database): the clients whose
        statistics its close keeps."""
        return ()

    def rolled_back(self, opens: int) -> tuple[Mapping[str, str], Mapping[str, np.ndarray]]:
        """The database was rolled back and round ``opens`` opens past the rounds the
        devices answered (:meth:`skipped`): the meta values to write with the skip and the
        announcement extras to set; none by default."""
        return {}, {}

    def before_commit(self, tallied: Tallied) -> None:  # noqa: B027 - a hook
        """The close is about to be written."""

    def committed(self, tallied: Tallied | None) -> None:  # noqa: B027 - a hook
        """The close (``None``: a skip) is written; a new round begins."""
