"""What a secure fleet's running sum holds of each device, checked against what each device
believes it holds, before the device's input goes in (issue 51).

The running sum (coordinator/rounds/secure.py) keeps, beside the statistics, the round of
each device's latest input in it (``held``), and the round it began (``since``: a sum
started again holds nothing of the rounds before). Each device advertises the round of its
latest input the sum holds as it knows it (``Advertise.summed``, -1 for none), with the
coordinator's own signed word for it (``receipt``: the round's :class:`~secagg.messages.Close`
saying its input is in the sum, or an :class:`~secagg.messages.Abort` of this kind). A
device adds its statistics less what it believes the sum holds of it, so the two must
agree, or the sum counts some data twice or never:

- **They agree**: the device takes part.
- **The sum holds a later input than the device knows of** (its close was lost: two MQTT
  sessions, a restart, a broker outage): its input of that round is in the sum, and adding
  its statistics less an older base would count the difference twice. It is refused this
  round with an abort saying which round the sum holds (``Abort.holds``); a device that
  had sent that input marks it summed then (edge_agent/secure_join.py), and takes part in
  the next round.
- **The device knows of a later input than the sum holds** (the database was restored
  from a backup, or lost its last rounds), shown by a receipt this coordinator signed in
  this run: the sum is behind, and no device's part of it can be taken out. The round
  aborts and the sum starts again, empty, from a later round (``since``), which the
  announcements say (``extras["secure_sum_since"]``), so that every device adds all of
  its statistics again. Without a valid receipt the claim is refused (excluded, told what
  the sum holds): one device cannot make the fleet start again by saying so.

A restored database may run again round numbers the devices hold receipts of, so the new
sum begins after the round of every receipt shown (``since`` is past them), and rounds
before it abort at once. The usual way a database falls behind, though, is rolled back
(a write-ahead log cut by a crash, a restored backup), which the devices' statuses show
before any of them joins (coordinator/rounds/run_reports.py): the round manager opens
the round after the last one they answered, and the sum starts again there
(:meth:`~coordinator.rounds.secure.SecureSum.rolled_back`), whether or not the lost
rounds added inputs, since that is what the database no longer knows. A receipt shown
here covers what statuses do not: a device whose input the record lacks though the
rounds were not rolled back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from secagg.errors import Excluded
from secagg.messages import Advertise, Roster, Stage
from secagg.result import SecAggResult
from secagg.server import SecAggServer


class RecordedServer(SecAggServer):
    """The secure-aggregation server of a closed-form secure fleet: an advertisement is
    checked against ``held`` (client -> the round of its latest input in the fleet's sum)
    first (module text). ``receipt_round`` reads a receipt (None: not this coordinator's
    signed word). ``behind``: the devices whose receipts show the sum behind them."""

    def __init__(
        self, *, held: Mapping[str, int], receipt_round: Callable[[str, bytes], int | None],
        fleet: str, round: int, since: int = 0,
        admit: Callable[[SecAggResult], str | None] = lambda result: None, **kwargs: object,
    ) -> None:  # fmt: skip
        super().__init__(fleet=fleet, round=round, **kwargs)  # type: ignore[arg-type]
        self.held = MappingProxyType(dict(held))
        self.since = since
        self._admit = admit
        self._receipt_round = receipt_round
        self.behind: dict[str, int] = {}

    def take_advertise(self, message: Advertise) -> None:
        u, says = message.client, message.summed
        if says < self.since:
            # A round before this sum began holds nothing in it: the device's own view
            # reads so too (edge_agent/secure_join.py::sum_view), and a receipt of such a
            # round, replayed, must not start the sum again.
            says = -1
        holds = self.held.get(u, -1)
        if says > holds and self._receipt_round(u, message.receipt) == says:
            self.behind[u] = says
        elif says != holds:
            whose = "none of its inputs" if holds < 0 else f"its input of round {holds}"
            raise Excluded(
                f"the fleet's sum holds {whose}, not what it says (round {says})",
                round=self.round, client=u, holds=holds,
            )  # fmt: skip
        super().take_advertise(message)

    @property
    def restart(self) -> int:
        """The round a sum started again begins at (module text); 0 when it need not."""
        if not self.behind:
            return 0
        return max(self.since, self.round + 1, max(self.behind.values()) + 1)

    def close_advertise(self) -> dict[str, Roster]:
        if self.behind:
            u = min(self.behind)
            holds = self.held.get(u, -1)
            self._abort(
                Stage.ADVERTISE,
                f"the fleet's sum is behind {len(self.behind)} device(s): it holds "
                f"{'none' if holds < 0 else f'round {holds}'} of {u}, whose receipt shows its "
                f"input of round {self.behind[u]} in it; the sum starts again from round "
                f"{self.restart}",
            )
        if self.round < self.since:
            self._abort(Stage.ADVERTISE, f"the fleet's sum starts again from round {self.since}")
        return super().close_advertise()

    def close_unmask(self) -> SecAggResult:
        """The round's sum, if the fleet's sum with it passes ``admit`` (the coordinator's
        admission, coordinator/rounds/secure_checks.py); else the round aborts, so that no
        device's close says its input is in a sum that was left out (it would believe it
        summed, and its receipt show the sum behind it)."""
        result = super().close_unmask()
        why = self._admit(result)
        if why is not None:
            self._abort(Stage.UNMASK, f"the round's sum fails admission ({why})")
        return result
