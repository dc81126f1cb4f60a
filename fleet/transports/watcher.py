"""Following a fleet over MQTT from outside: agents coming online, rounds announced,
agents finished."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from fleet.transports.spec import FLEET
from protocol import (
    FINISHED,
    AgentState,
    ProtocolError,
    RoundAnnouncement,
    Status,
    round_topic,
    status_filter,
)
from runtime.cliutil import CommandFailed

CONNECT_TIMEOUT_S = 10.0  # for the broker's answer to the watcher's first connection


class Watcher:
    """Follows the fleet over MQTT: agents coming online, rounds being announced."""

    def __init__(self, host: str, port: int, *, expected: int) -> None:
        import paho.mqtt.client as mqtt  # paho: only a run over MQTT needs it

        self.expected = expected
        self.online: set[str] = set()
        self.finished: set[str] = set()
        self.round = -1
        self._cond = threading.Condition()
        self._client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"fleet-watcher-{os.getpid()}"
        )
        self._round_topic = round_topic(FLEET)
        topics = [(self._round_topic, 1), (status_filter(FLEET), 1)]
        answered = threading.Event()
        answers: list[Any] = []

        def on_connect(client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
            if not reason.is_failure:
                client.subscribe(topics)
            answers.append(reason)
            answered.set()

        self._client.on_connect = on_connect
        self._client.on_message = self._on_message
        # Connected before anything is started: a wrong --broker would otherwise leave the
        # fleet waiting, silent, for the 30-minute no-progress limit.
        where = f"the MQTT broker at {host}:{port}"
        try:
            self._client.connect(host, port)
        except OSError as exc:
            raise CommandFailed(f"cannot reach {where}: {exc.strerror or exc}") from exc
        self._client.loop_start()
        if not answered.wait(timeout=CONNECT_TIMEOUT_S):
            self.close()
            raise CommandFailed(
                f"{where} did not answer an MQTT connection within {CONNECT_TIMEOUT_S:g} s"
            )
        if answers[0].is_failure:
            self.close()
            raise CommandFailed(f"{where} refused the connection: {answers[0]}")

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        try:
            if message.topic == self._round_topic:
                # No size cap: FedPCL's announcement to 200 agents (every padded local set)
                # is 2 MB, over the 1 MiB default, and ignoring it left the run waiting
                # until the coordinator's exit looked like a crash.
                ann = RoundAnnouncement.from_wire(message.payload, max_bytes=len(message.payload))
                with self._cond:
                    self.round = max(self.round, ann.round)
                    self._cond.notify_all()
            else:
                status = Status.from_wire(message.payload)
                with self._cond:
                    if status.state is AgentState.ONLINE:
                        self.online.add(status.client)
                        if status.reason == FINISHED:
                            self.finished.add(status.client)
                    self._cond.notify_all()
        except (ProtocolError, ValueError):
            return

    def _wait(
        self, done: Callable[[], bool], tick: Callable[[], None], alive: Callable[[], None]
    ) -> None:
        stalled_since = time.monotonic()
        seen = (self.round, len(self.online), len(self.finished))
        while True:
            with self._cond:
                progressed = self._cond.wait_for(done, timeout=1.0)
                tick()
                now = (self.round, len(self.online), len(self.finished))
            alive()  # also samples the fleet's memory, about once a second
            if progressed:
                return
            if now != seen:
                seen, stalled_since = now, time.monotonic()
            elif time.monotonic() - stalled_since > 1800:
                raise CommandFailed("the fleet made no progress for 30 minutes")

    def wait_online(self, bar: Any, alive: Callable[[], None]) -> None:
        def tick() -> None:
            bar.update(len(self.online) - bar.n)

        self._wait(lambda: len(self.online) >= self.expected, tick, alive)

    def wait_rounds(
        self, rounds: int, bar: Any, alive: Callable[[], None], closed: Callable[[int], None]
    ) -> None:
        """Until round ``rounds`` is announced; ``closed(n)`` once for each n rounds done."""

        reported = 0  # not bar.n: a disabled tqdm counts nothing

        def tick() -> None:
            nonlocal reported
            done = min(rounds, max(0, self.round))
            for n in range(reported + 1, done + 1):
                closed(n)
            reported = max(reported, done)
            bar.update(done - bar.n)

        self._wait(lambda: self.round >= rounds, tick, alive)

    def wait_finished(self, alive: Callable[[], None]) -> None:
        """Until every agent has handled the final announcement (and written what it
        scores there, such as FedAvg's last global-model accuracy)."""
        self._wait(lambda: len(self.finished) >= self.expected, lambda: None, alive)

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()
