"""A secure fleet's rounds (``privacy.aggregation = "secure"``): each coordinator round is
one secure-aggregation round over MQTT (secagg/), and the head is solved from the
sum it unmasks.

The service calls :meth:`SecureRounds.begin` for the open round before its announcement is
published: the round's own link subscribes to the devices' stage topics first, so no
device's key advertisement (sent once the announcement reaches it) finds nobody
listening. The four stages then run on a thread of their own, each closing when every
device it waits for has answered or its ``stage_timeout_s`` has passed; the outcome, the
decoded sum of the survivors or why the round aborted, goes to the round manager
(``deliver``: :meth:`~coordinator.rounds.manager.RoundManager.take_secure`), whose tally
(coordinator/rounds/secure.py) closes the round with it on the service's main loop. An aborted round announces the last head again.

What this coordinator holds of a device's statistics: nothing. Masked inputs are added
into one masked ring sum as they arrive (secagg/server.py), the unmasked sum is
the fleet's, noised when the table asks for noise, and neither is written to the
database or the log: the announced head is what is kept, as for every other method.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping

from coordinator.config import CoordinatorConfig
from coordinator.metrics import Metrics
from coordinator.rounds.secure import FleetSum, SecureOutcome
from coordinator.rounds.secure_record import RecordedServer
from protocol.auth import Signer, Verifier
from secagg.errors import RoundAborted
from secagg.fleet import SecureRelease
from secagg.messages import Stage
from secagg.mqtt import SecAggCoordinatorLink, StageDeadlines
from secagg.server import SecAggServer
from secagg.wire import CoordinatorWire

log = logging.getLogger(__name__)

#: ``protofleet_secure_stage``'s value for each stage (0: no secure round waits).
STAGE_NUMBERS = {stage: i for i, stage in enumerate(Stage, start=1)}

#: How long :meth:`SecureRounds.begin` waits for the round's link to reach the broker.
CONNECT_S = 30.0


class SecureRounds:
    """Runs the open round's secure aggregation beside the service's main loop: the
    outcome goes to ``deliver`` (which says whether the open round took it), then
    ``wake()`` is called. ``devices``: the enrolled devices' keys (none when insecure).
    ``metrics``: where each round's stage, outcome, time and survivors show. ``running``:
    the fleet's running sum when a round begins (None: none, FedProto), which each
    advertisement and the round's sum are checked against
    (coordinator/rounds/secure_record.py)."""

    def __init__(
        self,
        *,
        config: CoordinatorConfig,
        release: SecureRelease,
        run_id: str,
        signer: Signer | None,
        devices: Mapping[str, Verifier],
        deliver: Callable[[SecureOutcome], bool],
        wake: Callable[[], None],
        metrics: Metrics | None = None,
        running: Callable[[], FleetSum | None] = lambda: None,
    ) -> None:
        self.config, self.release, self.run_id = config, release, run_id
        self._running = running
        self.metrics = metrics
        if metrics is not None:
            plan = release.plan
            metrics.secure_round_epsilon.set(0.0 if plan is None else plan.epsilon)
        self.signer, self.devices = signer, devices
        self._deliver = deliver
        self._wake = wake
        self._round: int | None = None
        self._link: SecAggCoordinatorLink | None = None
        self._stopping = threading.Event()

    def begin(self, round_: int) -> None:
        """Listen for round ``round_``'s stage messages (once per round), then run it."""
        if self._round == round_ or self._stopping.is_set():
            return
        self._end_link()
        config, release = self.config, self.release
        timeout = config.secure_aggregation.stage_timeout_s
        wire = CoordinatorWire(
            fleet=config.fleet, run=self.run_id, signer=self.signer,
            devices=self.devices, max_bytes=config.mqtt.max_payload_bytes,
        )  # fmt: skip
        running = self._running()
        server = SecAggServer(fleet=config.fleet, round=round_, settings=release.settings)
        if running is not None:  # a running sum: each device's view of it is checked
            server = RecordedServer(
                held=running.held, since=running.since, receipt_round=wire.receipt_round,
                admit=lambda result: running.admission(result, round_=round_, release=release),
                fleet=config.fleet, round=round_, settings=release.settings,
            )  # fmt: skip
        link = SecAggCoordinatorLink(
            server=server,
            wire=wire,
            mqtt_settings=config.mqtt,
            # Its own MQTT client: the service's link keeps its session and subscriptions.
            client_id=f"{config.coordinator_id}-secagg",
            deadlines=StageDeadlines(
                advertise=timeout, share=timeout, masked_input=timeout, consistency=timeout,
                unmask=timeout,
            ),
            # Enrolled devices: once all of them have advertised, the first stage closes
            # without waiting out its deadline. An insecure fleet knows no list.
            expected=tuple(self.devices) or None,
            logger=log,
            on_stage=self._stage,
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
                round=round_, total=result.total, survivors=len(result.survivors),
                contributors=tuple(result.survivors),
            )  # fmt: skip
        except RoundAborted as exc:
            restart = link.server.restart if isinstance(link.server, RecordedServer) else 0
            outcome = SecureOutcome(round=round_, total=None, why=str(exc), restart=restart)
        except Exception as exc:  # a thread's error must still close the round
            log.exception("round %d: secure aggregation failed", round_)
            outcome = SecureOutcome(round=round_, total=None, why=f"{type(exc).__name__}: {exc}")
        finally:
            link.close()
        outcome = dataclasses.replace(outcome, seconds=time.monotonic() - started)
        self._record(outcome)
        if self._stopping.is_set():
            return
        if self._deliver(outcome):
            self._wake()

    def _stage(self, stage: Stage) -> None:
        if self.metrics is not None:
            self.metrics.secure_stage.set(STAGE_NUMBERS[stage])

    def _record(self, outcome: SecureOutcome) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        metrics.secure_stage.set(0)
        metrics.secure_rounds.labels(outcome="aborted" if outcome.total is None else "closed").inc()
        metrics.secure_round_seconds.observe(outcome.seconds)
        if outcome.total is not None:
            metrics.secure_survivors.set(outcome.survivors)

    def _end_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()

    def stop(self) -> None:
        """Stop listening; a round still running is abandoned (its devices time out)."""
        self._stopping.set()
        self._end_link()
