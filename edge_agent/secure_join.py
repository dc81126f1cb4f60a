"""The MQTT service's side of a secure fleet's rounds (edge_agent/secure_delivery.py makes
the inputs): the round's secure-aggregation protocol runs on a link of its own beside the
service's loop, and is settled when a later announcement says the coordinator closed the
round. Torch-free, as the service is (``edge-agent --help`` must not pay for torch)."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edge_agent.config import AgentConfig
from edge_agent.keys import AgentKeys
from edge_agent.state import StateDir
from protocol import RoundAnnouncement
from secagg.device import SecAggDevice
from secagg.messages import Abort, Close
from secagg.mqtt import FLUSH_S
from secagg.mqtt_device import SecAggDeviceLink
from secagg.settings import SecAggSettings
from secagg.wire import DeviceWire

log = logging.getLogger(__name__)

#: How long a device waits, once the next round is announced, for the coordinator's close
#: or abort of the secure round it joined (sent before that announcement, on another
#: session): the coordinator's own flush allowance (secagg/mqtt.py).
SETTLE_S = FLUSH_S


@dataclass(frozen=True)
class SecureInput:
    """This device's part of round ``round``'s secure sum: ``vector``, its statistics less
    what the sum holds of it already (or the round's prototype rows), for the protocol's
    ``settings``, under the coordinator run ``run``; ``version`` names the data they are
    of."""

    round: int
    run: str
    vector: np.ndarray
    settings: SecAggSettings
    version: str
    #: The statistics the fleet's sum holds of this device once ``vector`` is added
    #: (None for a prototype method, whose sums are the round's alone).
    statistics: np.ndarray | None
    #: Charges the privacy ledger for the sum's noise, just before the masked input
    #: leaves (False: the budget refuses, and it does not leave); None: nothing to pay.
    release: Callable[[], bool] | None = field(default=None, compare=False)
    #: The round the fleet's running sum began (the announcement's ``secure_sum_since``).
    since: int = 0


def sum_view(state: StateDir, *, run: str, since: int) -> tuple[int, bytes]:
    """What this device knows the fleet's running sum holds of it: the round of its latest
    input in it and the coordinator's signed word for that, or ``(-1, b"")`` for none in
    coordinator run ``run`` since round ``since`` (coordinator/rounds/secure_record.py)."""
    extra = state.snapshot.extra
    round_ = extra.get("statistics_summed_round")
    if extra.get("statistics_summed_run") != run or not isinstance(round_, int) or round_ < since:
        return -1, b""
    return round_, base64.b64decode(extra.get("statistics_summed_receipt", ""))


def pending(state: StateDir, secure: SecureInput) -> None:
    """Keep the statistics whose input is about to leave, before it does: should its close
    be lost, the coordinator's later word that the sum holds it finds them here."""
    if secure.statistics is None:
        return  # a prototype method's round: nothing carries over
    state.save_pending(secure.statistics, version=secure.version, run=secure.run,
                       round_=secure.round)  # fmt: skip


def summed(
    state: StateDir, *, run: str, round_: int, receipt: bytes, secure: SecureInput | None = None
) -> bool:
    """The fleet's sum holds this device's input of round ``round_`` (the coordinator's
    ``receipt`` says so): ``secure``'s statistics, that round's input, or else those kept
    as pending for that round (:func:`pending`), are now what it holds. False when there
    are none of that round (nothing is changed)."""
    if secure is not None and (secure.run, secure.round) == (run, round_):
        if secure.statistics is None:
            return False  # a prototype method's round: nothing carries over
        statistics, version = secure.statistics, secure.version
    elif (kept := state.load_pending()) is not None and kept[2:] == (run, round_):
        statistics, version = kept[0], kept[1]
    else:
        return False
    state.save_summed(statistics)
    state.record(statistics_summed=version, statistics_summed_run=run,
                 statistics_summed_round=round_,
                 statistics_summed_receipt=base64.b64encode(receipt).decode())  # fmt: skip
    return True


class SecureJoin:
    """The service's side: the secure round this device is adding to, and its link."""

    def __init__(self, *, cfg: AgentConfig, keys: AgentKeys, state: StateDir) -> None:
        self.cfg, self.keys, self.state = cfg, keys, state
        self._joined: tuple[SecureInput, SecAggDeviceLink, float] | None = None

    def join(self, secure: SecureInput) -> None:
        """Add this device's input to round ``secure.round``'s secure sum: the protocol
        runs on the link's own thread and MQTT client, beside the service's loop."""
        cfg, keys, state = self.cfg, self.keys, self.state
        holds, receipt = sum_view(state, run=secure.run, since=secure.since)
        device = SecAggDevice(
            client=cfg.agent_id, fleet=cfg.fleet, round=secure.round, settings=secure.settings,
            enrolment=keys.enrolment(cfg.agent_id, run=secure.run), summed=holds,
            receipt=receipt,
        )  # fmt: skip
        charge = secure.release

        def release() -> bool:
            pending(state, secure)  # kept before the input leaves, whatever follows
            return charge is None or charge()

        wire = DeviceWire(
            fleet=cfg.fleet, client=cfg.agent_id, run=secure.run, signer=keys.signer,
            coordinator=keys.coordinator, max_bytes=cfg.mqtt.max_payload_bytes, logger=log,
        )  # fmt: skip
        link = SecAggDeviceLink(
            device=device, vector=secure.vector, wire=wire, mqtt_settings=cfg.mqtt,
            client_id=f"{cfg.agent_id}-secagg", logger=log, release=release,
        )  # fmt: skip
        link.start()
        self._joined = (secure, link, time.monotonic())
        log.info("round %d: joining the fleet's secure sum", secure.round)

    def settle(self, announcement: RoundAnnouncement) -> None:
        """A later round's announcement means the coordinator closed the secure round this
        device joined: its statistics are in the fleet's sum if the coordinator's close
        says so, whatever this device saw of the stages (its masked input may be in the
        sum though its unmask answer never arrived, or out of it though it answered).
        The close or abort is sent before the next announcement, but on another MQTT
        session, so it is waited for a little (``SETTLE_S``)."""
        joined = self._joined
        if joined is None:
            return
        secure, link, started = joined
        if (announcement.round, announcement.run) == (secure.round, secure.run):
            return  # the same round, announced again
        self._joined = None
        notice = link.wait_settled(SETTLE_S)
        sent, received = link.traffic
        # The round's record gets the protocol's traffic (its update carried nothing).
        self.state.amend_round(
            secure.round, secagg_bytes_up=sent, secagg_bytes_down=received,
            secagg_seconds=time.monotonic() - started,
        )  # fmt: skip
        if isinstance(notice, Abort) and notice.holds is not None and notice.holds >= 0:
            # Refused for being wrong about what the sum holds of it: an input whose close
            # never came is in it after all.
            if summed(self.state, run=secure.run, round_=notice.holds, receipt=notice.to_wire()):
                log.warning("round %d: the fleet's sum holds this device's input of round %d "
                            "(its close was lost): marked summed", secure.round, notice.holds)  # fmt: skip
            else:
                log.error("round %d: the fleet's sum holds an input of round %d this device "
                          "kept no record of: %s", secure.round, notice.holds, notice.reason)  # fmt: skip
        elif isinstance(notice, Abort):
            log.warning(
                "round %d: secure aggregation aborted at %s: %s",
                secure.round, notice.stage.value, notice.reason,
            )  # fmt: skip
        elif isinstance(notice, Close) and notice.summed:
            summed(self.state, run=secure.run, round_=secure.round, receipt=notice.to_wire(),
                   secure=secure)  # fmt: skip
            log.info("round %d: statistics added to the fleet's secure sum", secure.round)
        else:
            answered = ", ".join(s.value for s in link.answered) or "none"
            why = "its input is not in the sum" if notice else f"no close came in {SETTLE_S:g} s"
            log.warning(
                "round %d: closed, and %s (this device answered %s); its statistics join a "
                "later round", secure.round, why, answered,
            )  # fmt: skip
        link.close()

    def close(self) -> None:
        if self._joined is not None:
            self._joined[1].close()
