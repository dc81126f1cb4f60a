"""A device's privacy ledger is charged for a secure round when its noised input leaves
it (issue 51, What to build 4): its link calls the charge once, before its masked input is
first published; a round that ends before costs nothing, and a device whose budget
refuses sends no masked input. Over a real Mosquitto, with tests/test_secagg_mqtt.py's
fleet of 20 device links."""

from __future__ import annotations

from collections import Counter

import pytest

from fleet.transports.broker import MosquittoBroker
from secagg.errors import RoundAborted
from secagg.messages import Stage
from tests.test_mqtt_link import Lines
from tests.test_secagg_mqtt import CLIENTS, SPARSE, fleet, lines

__all__ = ["lines"]  # the fixture, imported for pytest


@pytest.mark.broker
@pytest.mark.parametrize("aborted", [False, True], ids=["closed", "aborted-at-share"])
def test_a_device_is_charged_once_as_its_masked_input_leaves_and_never_before(
    mosquitto: MosquittoBroker, lines: Lines, aborted: bool
) -> None:
    # Before issue 51 a device paid when it joined, so an aborted round cost a whole
    # entry; now its link charges once, before its masked input first leaves, and dev-03,
    # whose budget refuses, sends none and drops there.
    charged: Counter[str] = Counter()

    def charge(c: str) -> bool:
        charged[c] += 1
        return c != "dev-03"

    leave = dict.fromkeys(CLIENTS[3:], Stage.ADVERTISE) if aborted else {}
    with fleet(mosquitto.address, SPARSE, leave=leave, logger=lines.logger,
               release=charge) as f:  # fmt: skip
        if aborted:  # three devices share keys: fewer than t = 4
            with pytest.raises(RoundAborted, match="3 devices shared keys"):
                f.run()
            assert charged == Counter()
            return
        result = f.run()
    assert charged == Counter(CLIENTS)
    assert result.dropped[Stage.MASKED_INPUT] == ("dev-03",)
    assert f.devices["dev-03"].drops.counts() == {"budget": 1}
