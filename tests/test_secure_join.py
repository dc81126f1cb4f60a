"""A device settles the secure round it joined from the coordinator's close alone
(edge_agent/secure_join.py, issue 51): its data is marked summed when the close says its
input is in the sum, whatever it saw of the stages, and not when the round aborted, even
when the abort arrives after the next announcement."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from edge_agent.config import AgentConfig
from edge_agent.keys import AgentKeys
from edge_agent.secure_join import SETTLE_S, SecureInput, SecureJoin
from edge_agent.state import StateDir
from protocol import RoundAnnouncement
from secagg.messages import Abort, Close, SecAggMessage, Stage
from tests.secagg_harness import FLEET, settings

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


def _settle(tmp_path: Path, link: Link) -> StateDir:
    state = StateDir(tmp_path / "state", agent_id="dev-01")
    # Settling reads only the state: the configuration and keys are the join's.
    join = SecureJoin(cfg=cast(AgentConfig, None), keys=cast(AgentKeys, None), state=state)
    secure = SecureInput(round=4, run=RUN, vector=np.zeros(3), settings=settings(n=5, threshold=3),
                         version="data-1", statistics=np.ones(3))  # fmt: skip
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
