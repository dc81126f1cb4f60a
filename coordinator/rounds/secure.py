"""A secure fleet's tally (``privacy.aggregation = "secure"``, coordinator/rounds/tally.py):
each coordinator round is closed by the outcome of its secure-aggregation round
(coordinator/rounds/secure_rounds.py runs it over MQTT), not by counting updates.

- lda and ridge: the round's unmasked sum is added to the fleet's running sum
  (:class:`FleetSum`, kept in the meta table with the round's close in the one encoding
  of summed statistics, closed_form/encoding.py), and the head is solved from it; an
  aborted round announces the same head again. The sum with the round's must pass
  coordinator/rounds/secure_checks.py: a round whose sum fails is left out, and the last
  head is announced again (coordinator/rounds/head_guard.py), naming the round.
- FedProto: each class's summed rows over its holder count, the round's global
  prototypes, for the classes at least ``t`` devices hold (secagg/fleet.py); an aborted
  round announces the last ones again.

No device's statistics are ever stored here, so none are summed update by update.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

import closed_form as cf
from coordinator.rounds.head_guard import guarded, last_head
from coordinator.rounds.open_round import OpenRound
from coordinator.rounds.secure_checks import sum_problem
from coordinator.rounds.tally import Tallied, Tally
from coordinator.storage.store import Store
from coordinator.strategies import Aggregate, Strategy
from coordinator.strategies.closed_form import ClosedForm
from protocol import ProtocolError, RoundAnnouncement
from protocol.codec import pack, unpack
from secagg.fleet import SecureRelease, global_prototypes, since_extra, unflatten
from secagg.plan import decoded_noise_std
from secagg.result import SecAggResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecureOutcome:
    """How round ``round`` ended: ``total`` is the decoded sum of ``survivors`` devices'
    inputs, or None when the round aborted (``why``)."""

    round: int
    total: np.ndarray | None
    survivors: int = 0
    why: str = ""
    #: From the round's link subscribing to its outcome.
    seconds: float = 0.0
    #: Whose inputs are in ``total`` (the survivors' ids).
    contributors: tuple[str, ...] = ()
    #: The round aborted because the fleet's sum is behind the devices: it starts again,
    #: empty, at this round (0: it does not).
    restart: int = 0


#: The meta-table key of a secure fleet's running sum (coordinator/storage/store.py).
SUM_KEY = "secure_sum"
#: The version of its value: 3 is the one encoding of summed statistics
#: (closed_form/encoding.py) with the record of whose inputs it holds (``held``, ``since``).
_SUM_VERSION = 3
#: Earlier versions (1, a flat vector; 2, without the record): read as a sum to start again.
_EARLIER = (1, 2)


@dataclass(frozen=True, eq=False)
class FleetSum:
    """A secure fleet's statistics: every secure round's unmasked sum, added with the
    running sum every sum of statistics is taken with (closed_form/statistics.py). A device
    adds its statistics once per data version, and after new data the difference from what
    it added before (edge_agent/agent.py), so the running sum is every device's latest, as
    a plain fleet's coordinator/rounds/statistics.py holds it. ``stats.devices``: how many
    device inputs went into it (a device that adds a difference counts again). Which device
    holds which class is not in a sum: a class counts as held where its summed count is at
    least one example (secagg/fleet.py::unflatten). ``held``: the round of each device's
    latest input in it, and ``since`` the round it began, which devices check their own
    view against (coordinator/rounds/secure_record.py)."""

    stats: cf.Statistics
    held: Mapping[str, int] = field(default_factory=dict)
    since: int = 0

    @property
    def devices(self) -> int:
        return self.stats.devices

    @classmethod
    def empty(cls, release: SecureRelease, *, since: int = 0) -> FleetSum:
        return cls(stats=cf.Statistics.empty(
            num_classes=release.classes, dim=release.k, gram=release.gram
        ), since=since)  # fmt: skip

    def plus(self, outcome: SecureOutcome, release: SecureRelease) -> FleetSum:
        """This sum and ``outcome``'s (itself when the round aborted; an empty one from the
        next round when it aborted because this one is behind the devices)."""
        if outcome.restart:
            return FleetSum.empty(release, since=outcome.restart)
        if outcome.total is None:
            return self
        total = cf.StatisticsSum.of(self.stats)
        total.add(_unflattened(outcome.total, release, devices=outcome.survivors))
        held = {**self.held, **dict.fromkeys(outcome.contributors, outcome.round)}
        return FleetSum(stats=_held_by_count(total.total()), held=held, since=self.since)

    def admission(self, result: SecAggResult, *, round_: int, release: SecureRelease) -> str | None:
        """Why this sum with round ``round_``'s ``result`` fails the coordinator's
        admission (coordinator/rounds/secure_checks.py), if it does."""
        outcome = SecureOutcome(round=round_, total=result.total, survivors=len(result.survivors))
        return sum_problem(self.plus(outcome, release).stats, release)

    def to_meta(self) -> str:
        fields = cf.statistics_fields(self.stats)
        return json.dumps({
            "v": _SUM_VERSION, "statistics": base64.b64encode(pack(fields)).decode(),
            "held": dict(sorted(self.held.items())), "since": self.since,
        })  # fmt: skip

    @classmethod
    def load(cls, text: str | None, *, release: SecureRelease) -> FleetSum:
        """The sum the store kept (an empty one when it kept none). A kept sum of another
        shape (the fleet's k or classes changed) is not the fleet's: it is left out, said."""
        if text is None:
            return cls.empty(release)
        try:
            data = json.loads(text)
            version = data.get("v", 1)
            if version in _EARLIER:
                # Which device's data it holds is unknown: it starts again, and every
                # device adds all of its statistics (theirs record no round either).
                raise ValueError(f"version {version} predates the record of whose inputs it holds")
            if version != _SUM_VERSION:
                raise ValueError(f"version {version!r}, not {_SUM_VERSION}")
            blob = base64.b64decode(data["statistics"])
            stats = cf.statistics_from(unpack(blob, max_bytes=len(blob)),
                                       num_classes=release.classes, dim=release.k)  # fmt: skip
            held = {str(c): int(r) for c, r in data["held"].items()}
            since = int(data["since"])
        except (ValueError, KeyError, TypeError, AttributeError, ProtocolError) as exc:
            log.warning("the stored secure sum is left out: %s", exc)
            return cls.empty(release)
        if (stats.gram is None) == release.gram:
            log.warning("the stored secure sum is of another kind than this fleet's: left out")
            return cls.empty(release)
        return cls(stats=stats, held=held, since=since)


def _unflattened(total: np.ndarray, release: SecureRelease, *, devices: int) -> cf.Statistics:
    return unflatten(total, k=release.k, classes=release.classes, gram=release.gram,
                     devices=devices)  # fmt: skip


def _held_by_count(stats: cf.Statistics) -> cf.Statistics:
    """``stats`` with a class held where its count is at least one example (module text):
    the rounds' own held flags add up to how many rounds held it, not how many devices."""
    held = (stats.counts >= 1.0) & (stats.devices > 0)
    return cf.Statistics(counts=stats.counts, sums=stats.sums, gram=stats.gram,
                         holders=held.astype(np.int64), scatter=stats.scatter,
                         devices=stats.devices)  # fmt: skip


class SecureSum(Tally):
    """Closes a round with its secure-aggregation round's outcome (module text)."""

    closes_itself = True

    def __init__(self, *, release: SecureRelease, store: Store, strategy: Strategy) -> None:
        self.release, self.store = release, store
        self.strategy = strategy
        self._outcome: SecureOutcome | None = None
        self.sum: FleetSum | None = None
        self._restarted: FleetSum | None = None
        if not release.prototypes:
            assert isinstance(strategy, ClosedForm)  # config.secure_problem checked it
            self.sum = FleetSum.load(store.meta_value(SUM_KEY), release=release)

    def offer(self, outcome: SecureOutcome, *, open_round: int) -> bool:
        """The secure round of ``outcome.round`` has ended: the cycle closes the open round
        with it. False for another round's (a late one)."""
        if outcome.round != open_round:
            return False
        self._outcome = outcome
        return True

    def ready(self) -> bool:
        return self._outcome is not None

    def tally(self, closing: OpenRound, *, now: float, last: RoundAnnouncement) -> Tallied:
        outcome, self._outcome = self._outcome, None
        assert outcome is not None  # ready() said so
        clients = self.store.update_clients(closing.number)
        if outcome.total is None:
            log.warning(
                "round %d: secure aggregation aborted (%s); the last global state stays",
                outcome.round, outcome.why,
                extra={"event": "secure_aborted", "round": outcome.round},
            )  # fmt: skip
        after: FleetSum | None = None
        kept = ""
        if self.release.prototypes:
            result = self._prototypes(outcome, last)
        else:
            assert self.sum is not None
            after = self.sum.plus(outcome, self.release)
            if after.devices == 0 and after.since > 0:
                # Started again (behind the devices): they add all of their statistics
                # again from round ``since``; the head stays until they have.
                kept = f"the fleet's secure sum starts again from round {after.since}"
                result = last_head(last)
            elif (why := sum_problem(after.stats, self.release)) is not None:
                # Refused whole: the round's sum is not added, and the head stays.
                kept = f"the secure sum of round {outcome.round} fails admission ({why})"
                after = self.sum
                result = last_head(last)
            else:
                result, kept = guarded(self._head(after), last)
        if after is not None:
            # Devices check what they believe the sum holds of them against its start.
            result = replace(result, extras={**result.extras, **since_extra(after.since)})
        if outcome.total is not None:
            log.info(
                "round %d: head solved from the secure sum of %d device(s) (%.1f s)",
                closing.number, outcome.survivors, outcome.seconds,
                extra={"event": "secure_sum", "round": closing.number,
                       "devices": outcome.survivors, "seconds": outcome.seconds},
            )  # fmt: skip
        return Tallied(
            result, updates=len(clients), source=",".join(clients), counted=False,
            meta={} if after is None else {SUM_KEY: after.to_meta()}, detail=after, kept=kept,
        )  # fmt: skip

    def _head(self, after: FleetSum) -> Aggregate:
        """The head of the fleet's running sum (none before any device's input)."""
        if after.devices == 0:
            return Aggregate()
        release = self.release
        assert isinstance(self.strategy, ClosedForm)
        # The sum's noise is public (the plan's and the rounding's): the solve keeps the
        # directions it swamps from being amplified (closed_form/heads.py::lda_head).
        noise = decoded_noise_std(
            spec=release.settings.spec, plan=release.plan, devices=after.devices
        )
        return self.strategy.solve_statistics(after.stats, noise_std=noise)

    def _prototypes(self, outcome: SecureOutcome, last: RoundAnnouncement) -> Aggregate:
        """FedProto's global prototypes of the round's sum; the announced ones again when
        the round aborted."""
        if outcome.total is None:
            return Aggregate(
                global_classes=last.global_classes,
                global_prototypes=np.asarray(last.global_prototypes, dtype=np.float64),
            )
        # Only classes at least t devices hold are announced (secagg/fleet.py).
        rows, has = global_prototypes(outcome.total, dim=self.release.k,
                                      classes=self.release.classes,
                                      threshold=self.release.settings.fewest)  # fmt: skip
        return Aggregate(
            global_classes=tuple(int(c) for c in np.flatnonzero(has)), global_prototypes=rows[has]
        )

    def rolled_back(self, opens: int) -> tuple[dict[str, str], dict[str, np.ndarray]]:
        """The rounds this database lost may have added inputs to the sum that it no longer
        holds, and no device's part can be taken out: the sum starts again, empty, at round
        ``opens`` (which the devices have not answered), and every device adds all of its
        statistics again (coordinator/rounds/secure_record.py)."""
        if self.sum is None:
            return {}, {}  # FedProto: no running sum
        self._restarted = FleetSum.empty(self.release, since=opens)
        log.warning(
            "round %d: the fleet's secure sum may lack inputs of the rounds the database "
            "lost: it starts again, and every device adds its statistics again", opens,
            extra={"event": "secure_sum_restarted", "round": opens},
        )  # fmt: skip
        return {SUM_KEY: self._restarted.to_meta()}, since_extra(opens)

    def committed(self, tallied: Tallied | None) -> None:
        if tallied is None and self._restarted is not None:
            self.sum, self._restarted = self._restarted, None
        if tallied is not None and tallied.detail is not None:
            self.sum = tallied.detail
