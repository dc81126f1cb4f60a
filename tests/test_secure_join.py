"""A device settles the secure round it joined from the coordinator's close alone
(edge_agent/secure_join.py, issue 51): its data is marked summed when the close says its
input is in the sum, whatever it saw of the stages, and not when the round aborted, even
when the abort arrives after the next announcement; an input whose close was lost is
marked when the coordinator later says the sum holds it; and a new run's sum, or one
started again, gets all of its statistics."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from edge_agent.config import AgentConfig
from edge_agent.keys import AgentKeys
from edge_agent.secure_join import SETTLE_S, SecureInput, SecureJoin, pending, sum_view
from edge_agent.state import StateDir
from protocol import RoundAnnouncement
from secagg.fleet import SINCE_EXTRA
from secagg.messages import Abort, Close, SecAggMessage, Stage
from tests.agent_helpers import announcement
from tests.secagg_harness import FLEET, settings
from tests.test_secure_fleet import K, _secure_agent

RUN = "0123456789abcdef"
ALL = tuple(Stage)
NO_UNMASK = ALL[:-1]


class Link:
    """What settling reads of a device's link: ``notice`` (a close, an abort, or None) is
    not there yet when the next round is announced, and arrives while it is waited for."""

    def __init__(self, *, answered: tuple[Stage, ...], notice: SecAggMessage | None) -> None:
        self.answered = answered
        self._notice = notice
        self.abort: Abort | None = None
        self.traffic = (100, 200)
        self.waited: float | None = None
        self.closed = False

    def wait_settled(self, timeout: float) -> SecAggMessage | None:
        self.waited = timeout
        if isinstance(self._notice, Abort):
            self.abort = self._notice
        return self._notice

    def close(self) -> None:
        self.closed = True


def _input(round_: int, version: str = "data-1") -> SecureInput:
    return SecureInput(round=round_, run=RUN, vector=np.zeros(3),
                       settings=settings(n=5, threshold=3), version=version,
                       statistics=np.full(3, float(round_)))  # fmt: skip


def _settle(tmp_path: Path, link: Link, *, before: SecureInput | None = None) -> StateDir:
    state = StateDir(tmp_path / "state", agent_id="dev-01")
    if before is not None:
        pending(state, before)  # an earlier round's input left, and its close never came
    # Settling reads only the state: the configuration and keys are the join's.
    join = SecureJoin(cfg=cast(AgentConfig, None), keys=cast(AgentKeys, None), state=state)
    secure = _input(4)
    join._joined = (secure, cast(Any, link), 0.0)  # as join() leaves it, on a stub link
    join.settle(cast(RoundAnnouncement, SimpleNamespace(round=5, run=RUN)))
    assert link.waited == SETTLE_S and link.closed
    return state


def close(summed: bool) -> Close:
    return Close(fleet=FLEET, round=4, client="dev-01", summed=summed)


LATE_ABORT = Abort(fleet=FLEET, round=4, client="dev-01", stage=Stage.UNMASK, reason="few")


@pytest.mark.parametrize(
    ("answered", "notice", "in_sum"),
    [
        # Its unmask answer never reached the coordinator, but its masked input did.
        (NO_UNMASK, close(True), True),
        # It answered every stage, and the coordinator left its input out.
        (ALL, close(False), False),
        # It answered every stage; the abort came after the next announcement.
        (ALL, LATE_ABORT, False),
        (ALL, close(True), True),
    ],
    ids=["unmask-lost", "left-out", "late-abort", "summed"],
)
def test_a_device_marks_its_data_summed_from_the_close_alone(
    tmp_path: Path, answered: tuple[Stage, ...], notice: SecAggMessage, in_sum: bool
) -> None:
    state = _settle(tmp_path, Link(answered=answered, notice=notice))
    assert (state.snapshot.extra.get("statistics_summed") == "data-1") is in_sum
    assert (state.snapshot.extra.get("statistics_summed_run") == RUN) is in_sum


def test_without_a_close_the_data_joins_a_later_round_and_the_log_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    state = _settle(tmp_path, Link(answered=ALL, notice=None))
    assert "statistics_summed" not in state.snapshot.extra
    assert f"no close came in {SETTLE_S:g} s (this device answered advertise" in caplog.text


def held(round_: int, holds: int) -> Abort:
    return Abort(fleet=FLEET, round=round_, client="dev-01", stage=Stage.ADVERTISE,
                 reason="this device is refused: the fleet's sum holds ...", holds=holds)  # fmt: skip


def test_an_input_whose_close_was_lost_is_marked_when_the_coordinator_says_the_sum_holds_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Round 3's input left (kept as pending) and its close was lost; round 4 is refused
    # with what the sum holds: round 3's. That is what the device now believes it holds.
    notice = held(4, 3)
    state = _settle(tmp_path, Link(answered=ALL[:1], notice=notice), before=_input(3, "data-0"))
    extra = state.snapshot.extra
    assert (extra["statistics_summed"], extra["statistics_summed_round"]) == ("data-0", 3)
    np.testing.assert_array_equal(state.load_summed(3), np.full(3, 3.0))
    # The coordinator's signed word is kept, to show it should the sum ever fall behind.
    assert sum_view(state, run=RUN, since=0) == (3, notice.to_wire())
    assert (
        "the fleet's sum holds this device's input of round 3 (its close was lost)" in caplog.text
    )


def test_a_round_the_device_kept_nothing_of_marks_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = _settle(tmp_path, Link(answered=ALL[:1], notice=held(4, 2)), before=_input(3))
    assert "statistics_summed" not in state.snapshot.extra
    assert "holds an input of round 2 this device kept no record of" in caplog.text


def test_what_the_device_believes_the_sum_holds_is_of_its_run_and_since_the_sum_began(
    tmp_path: Path,
) -> None:
    state = _settle(tmp_path, Link(answered=ALL, notice=close(True)))
    assert sum_view(state, run=RUN, since=4)[0] == 4
    assert sum_view(state, run=RUN, since=5) == (-1, b"")  # a sum started again since
    assert sum_view(state, run="fedcba9876543210", since=0) == (-1, b"")


def test_a_device_joins_a_new_runs_sum_or_one_started_again_with_all_of_its_statistics(
    small_zoo: Path, tmp_path: Path
) -> None:
    # Issue 51: a device kept "summed" across runs, so a new run's empty sum never got it.
    agent = _secure_agent(tmp_path, small_zoo, budget=5.0, epsilon=1.0)
    bundle = agent.bundle_id
    first = agent.handle(announcement(bundle, 0, "lda", dim=K))
    assert first.secure is not None
    agent.summed(first.secure)
    assert agent.handle(announcement(bundle, 1, "lda", dim=K)).reason == "nothing_new"
    # The coordinator's sum fell behind the devices and started again from round 2.
    restarted = dataclasses.replace(announcement(bundle, 2, "lda", dim=K),
                                    extras={SINCE_EXTRA: np.array([2.0], np.float32)})  # fmt: skip
    again = agent.handle(restarted)
    assert again.reason == "secure" and again.secure is not None and again.secure.since == 2
    np.testing.assert_array_equal(again.secure.vector, first.secure.vector)
    agent.summed(again.secure)
    assert agent.handle(dataclasses.replace(restarted, round=3)).reason == "nothing_new"
    # The coordinator's database is lost: a later run, whose sum holds nothing of it.
    fresh = dataclasses.replace(announcement(bundle, 0, "lda", dim=K), run="fedcba9876543210",
                                run_started=announcement(bundle, 0).run_started + 60)  # fmt: skip
    new_run = agent.handle(fresh)
    assert new_run.reason == "secure" and new_run.secure is not None
    np.testing.assert_array_equal(new_run.secure.vector, first.secure.vector)
    agent.summed(new_run.secure)
    assert agent.handle(dataclasses.replace(fresh, round=1)).reason == "nothing_new"
