"""A secure fleet's rounds (``privacy.aggregation = "secure"``): each coordinator round is
one secure-aggregation round over MQTT (runtime/secagg/), and the head is solved from the
sum it unmasks.

The service calls :meth:`SecureRounds.begin` for the open round before its announcement is
published: the round's own link subscribes to the devices' stage topics first, so no
device's key advertisement (sent once the announcement reaches it) finds nobody
listening. The four stages then run on a thread of their own, each closing when every
device it waits for has answered or its ``stage_timeout_s`` has passed; the outcome, the
decoded sum of the survivors or why the round aborted, goes to the round manager
(:meth:`~coordinator.rounds.RoundManager.take_secure`), which closes the round with it
on the service's main loop. An aborted round announces the last head again.

What this coordinator holds of a device's statistics: nothing. Masked inputs are added
into one masked ring sum as they arrive (runtime/secagg/server.py), the unmasked sum is
the fleet's, noised when the table asks for noise, and neither is written to the
database or the log: the announced head is what is kept, as for every other method.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runtime.secagg.errors import RoundAborted
from runtime.secagg.mqtt import SecAggCoordinatorLink, StageDeadlines
from runtime.secagg.server import SecAggServer
from runtime.secagg.wire import CoordinatorWire

if TYPE_CHECKING:
    from collections.abc import Callable

    from coordinator.rounds import RoundManager

log = logging.getLogger(__name__)

#: How long :meth:`SecureRounds.begin` waits for the round's link to reach the broker.
CONNECT_S = 30.0


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


#: The meta-table key of a secure fleet's running sum (coordinator/store.py).
SUM_KEY = "secure_sum"


@dataclass(frozen=True)
class FleetSum:
    """A secure fleet's statistics: the sum of every secure round's unmasked sum. A device
    adds its statistics once per data version, and after new data the difference from
    what it added before (edge_agent/agent.py), so the running sum is every device's
    latest, as a plain fleet's coordinator/statistics.py holds it. ``devices``: how many
    device inputs went into it (a device that adds a difference counts again)."""

    total: np.ndarray
    devices: int = 0

    @classmethod
    def empty(cls, length: int) -> FleetSum:
        return cls(total=np.zeros(length))

    def plus(self, outcome: SecureOutcome) -> FleetSum:
        """This sum and ``outcome``'s (itself when the round aborted)."""
        if outcome.total is None:
            return self
        return FleetSum(total=self.total + outcome.total, devices=self.devices + outcome.survivors)

    def to_meta(self) -> str:
        return json.dumps(
            {"devices": self.devices, "total": base64.b64encode(self.total.tobytes()).decode()}
        )

    @classmethod
    def load(cls, text: str | None, *, length: int) -> FleetSum:
        """The sum the store kept (an empty one when it kept none). A kept sum of another
        length (the fleet's k or classes changed) is not the fleet's: it is left out, said."""
        if text is None:
            return cls.empty(length)
        try:
            data = json.loads(text)
            total = np.frombuffer(base64.b64decode(data["total"]), dtype=np.float64).copy()
            devices = int(data["devices"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("the stored secure sum is unreadable and left out: %s", exc)
            return cls.empty(length)
        if total.shape != (length,):
            log.warning(
                "the stored secure sum has %d values, not this fleet's %d: left out",
                total.size, length,
            )  # fmt: skip
            return cls.empty(length)
        return cls(total=total, devices=devices)


class SecureRounds:
    """Runs the open round's secure aggregation beside the service's main loop;
    ``wake()`` is called once the outcome is with the manager."""

    def __init__(self, *, manager: RoundManager, wake: Callable[[], None]) -> None:
        assert manager.secure is not None, "a secure fleet's manager"
        self.manager = manager
        self._wake = wake
        self._round: int | None = None
        self._link: SecAggCoordinatorLink | None = None
        self._stopping = threading.Event()

    def begin(self, round_: int) -> None:
        """Listen for round ``round_``'s stage messages (once per round), then run it."""
        if self._round == round_ or self._stopping.is_set():
            return
        self._end_link()
        manager, config = self.manager, self.manager.config
        release = manager.secure
        assert release is not None
        timeout = config.secure_aggregation.stage_timeout_s
        link = SecAggCoordinatorLink(
            server=SecAggServer(fleet=config.fleet, round=round_, settings=release.settings),
            wire=CoordinatorWire(
                fleet=config.fleet, run=manager.run_id, signer=manager.keys.signer,
                devices=manager.keys.devices, max_bytes=config.mqtt.max_payload_bytes,
            ),
            mqtt_settings=config.mqtt,
            # Its own MQTT client: the service's link keeps its session and subscriptions.
            client_id=f"{config.coordinator_id}-secagg",
            deadlines=StageDeadlines(
                advertise=timeout, share=timeout, masked_input=timeout, unmask=timeout
            ),
            # Enrolled devices: once all of them have advertised, the first stage closes
            # without waiting out its deadline. An insecure fleet knows no list.
            expected=tuple(manager.keys.devices) or None,
            logger=log,
        )  # fmt: skip
        started = time.monotonic()
        link.start()
        if not link.link.wait_connected(CONNECT_S):
            log.warning(
                "round %d: the secure-aggregation link has not reached the broker in %.0f s; "
                "the round goes on and its first stage waits for it", round_, CONNECT_S,
            )  # fmt: skip
        self._round, self._link = round_, link
        threading.Thread(
            target=self._run,
            args=(link, round_, started),
            name=f"secagg-round-{round_}",
            daemon=True,
        ).start()

    def _run(self, link: SecAggCoordinatorLink, round_: int, started: float) -> None:
        try:
            result = link.run()
            outcome = SecureOutcome(
                round=round_, total=result.total, survivors=len(result.survivors)
            )
        except RoundAborted as exc:
            outcome = SecureOutcome(round=round_, total=None, why=str(exc))
        except Exception as exc:  # a thread's error must still close the round
            log.exception("round %d: secure aggregation failed", round_)
            outcome = SecureOutcome(round=round_, total=None, why=f"{type(exc).__name__}: {exc}")
        finally:
            link.close()
        outcome = dataclasses.replace(outcome, seconds=time.monotonic() - started)
        if self._stopping.is_set():
            return
        if self.manager.take_secure(outcome):
            self._wake()

    def _end_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()

    def stop(self) -> None:
        """Stop listening; a round still running is abandoned (its devices time out)."""
        self._stopping.set()
        self._end_link()
