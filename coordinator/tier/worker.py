"""One coordinator worker: a member of an MQTT 5 shared subscription on the fleet's updates.

The broker hands each update published on ``protofleet/v1/<fleet>/update/<client>`` to one
member of the group ``$share/<group>/...``, so N workers each see about 1/N of the fleet.
What a worker does to each message is :class:`coordinator.tier.intake.Intake`'s (signatures,
admission, the open round, durable storage, receipts, partial sums); this module carries
the messages, over the services' one link (runtime/mqtt_link.py, here speaking MQTT 5):
updates from the shared subscription, the coordinator's retained announcement, the
combiner's collect requests, and the receipts and partials back.

Three departures from paho's defaults, two for durability and one for speed, all the
link's:

- a persistent session (``clean_start=False`` and a session expiry): the broker keeps the
  worker's share of the group, and the updates it had sent but not had acknowledged, while
  the worker is down, and delivers them when the same worker id comes back;
- manual acknowledgement: a QoS 1 update is acknowledged only after it is committed (and
  its receipt queued), as coordinator/service/service.py does. A worker killed before its commit
  gets the update again; one killed after it finds the copy stored and answers it as a
  duplicate, with the same receipt;
- bulk reading (runtime/bulkread.py, as the coordinator reads): every packet a ``recv()``
  brings is handled (an MQTT 5 one by paho's own handler) and their acknowledgements go
  out as one write, where paho reads one packet per ``select()``. A worker rejects wrongly
  signed updates about a sixth faster with it (20,000 queued for one worker, four runs
  each, 2026-11-26: 2,620-2,820 a second against 2,040-2,360), so a flood overflows the
  broker's queue, and drops honest updates with it, later.

``edge-coordinator worker --config coordinator.toml --name w1`` (or ``python -m
coordinator.tier.worker``, the same options) runs one worker on the coordinator's own
configuration (fleet, model, admission, ``[security]`` with the
coordinator's key and the enrolled devices, ``[mqtt]``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sqlite3
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import paho.mqtt.client as mqtt

from coordinator import config as config_mod
from coordinator.decision import Decision
from coordinator.keys import CoordinatorKeys
from coordinator.storage.group_sync import GroupSync
from coordinator.tier.intake import Intake
from coordinator.tier.partial_wire import CollectRequest, collect_topic, partial_topic
from coordinator.tier.worker_store import WorkerStore
from protocol import ProtocolError, round_topic, update_filter, validate_id
from protocol.receipts import REFUSALS
from protocol.topics import receipt_topic
from runtime.mqtt_link import MqttLink, Reconnect
from runtime.sdnotify import Notifier, Watchdog
from runtime.transport import MqttSettings

log = logging.getLogger(__name__)

#: How long the broker keeps a worker's session (its share of the group and its
#: unacknowledged updates) after the worker goes: a day covers a restart and most outages.
SESSION_EXPIRY_S = 86_400


def shared_update_filter(group: str, fleet: str) -> str:
    """``$share/<group>/protofleet/v1/<fleet>/update/+`` (MQTT 5, section 4.8.2)."""
    return f"$share/{validate_id(group, field='group')}/{update_filter(fleet)}"


class Worker:
    """``with Worker(...) as w:`` connects, subscribes and waits for the SUBACK.

    ``on_update`` is called (on paho's network thread) with each update's
    :class:`~coordinator.tier.intake.Decision` once it is handled and its receipt queued.
    """

    def __init__(
        self,
        *,
        intake: Intake,
        group: str,
        mqtt_settings: MqttSettings | None = None,
        session_expiry_s: int = SESSION_EXPIRY_S,
        on_update: Callable[[Decision], None] | None = None,
        group_sync: bool = False,
    ) -> None:
        self.intake = intake
        self.name = intake.name
        self.fleet = intake.fleet
        self.settings = mqtt_settings or MqttSettings()
        self.filter = shared_update_filter(group, self.fleet)
        self.session_expiry_s = session_expiry_s
        self._on_update = on_update
        self._heard = threading.Event()
        #: A storage error stops the intake: nothing more is acknowledged, so the broker
        #: delivers it again to this worker's session once it is restarted.
        self.fault: BaseException | None = None
        self._told: set[tuple[int, str]] = set()  # (round, client) refusals sent
        # sqlite_synchronous = "GROUP": receipts and partials wait for one fsync of the
        # log that covers the rows they speak of (coordinator/storage/group_sync.py).
        self._sync = (
            GroupSync(intake.store.path, on_error=self._sync_failed) if group_sync else None
        )
        # MQTT 5 (shared subscriptions do not exist in 3.1.1, which the device-facing
        # services speak) with a persistent session; the round topic is among the
        # subscriptions asked for on every connect, as the broker sends a retained
        # message on a subscription, not on a resumed session.
        self.link = MqttLink(
            settings=self.settings,
            client_id=f"{self.fleet}-worker-{self.name}",
            subscriptions=(round_topic(self.fleet), collect_topic(self.fleet), self.filter),
            on_connected=lambda: None,
            on_message=self._on_message,
            reconnect=Reconnect(jittered=False, cap_s=5.0),
            manual_ack=True,
            session_expiry_s=session_expiry_s,
            logger=log,
        )

    def start(self, *, timeout: float = 10.0) -> Worker:
        self.link.start()
        if not self.link.wait_connected(timeout):
            self.stop()
            raise TimeoutError(f"worker {self.name}: no SUBACK within {timeout} s")
        if self.link.refused_subscriptions:
            self.stop()
            raise ConnectionError(
                f"worker {self.name}: broker refused {self.link.refused_subscriptions}"
            )
        return self

    def wait_heard(self, timeout: float) -> bool:
        """Whether the round topic's retained message came (and was judged) in time."""
        return self._heard.wait(timeout)

    def stop(self) -> None:
        if self._sync is not None:
            self._sync.close()
        self.link.close()

    def _sync_failed(self, exc: BaseException) -> None:
        log.error("worker %s: fsync failed, intake stopped: %s", self.name, exc)
        self.fault = exc

    def _publish(self, topic: str, payload: bytes) -> None:
        """Publish now, or (group commit) once the log is fsync'd past what it says."""
        if self._sync is None:
            self.link.publish(topic, payload)
        else:
            self._sync.after_sync(lambda: self.link.publish(topic, payload))

    def healthy(self) -> bool:
        """For systemd's watchdog: no storage fault, and paho's network thread alive (its
        death would mean no reconnects)."""
        return self.fault is None and self.link.healthy()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the link's events (paho's network thread) --------------------------------------

    def _on_message(self, message: mqtt.MQTTMessage) -> bool:
        """Whether ``message`` is handled: only then does the link acknowledge it."""
        # Nothing may escape into paho's network thread: an exception there ends it.
        if self.fault is not None:
            return False  # unacknowledged: delivered again to this session after a restart
        try:
            self._handle(message)
        except (sqlite3.Error, OSError) as exc:
            log.error("worker %s: storage error, intake stopped: %s", self.name, exc)
            self.fault = exc
            return False
        except Exception as exc:
            log.exception("worker %s: unexpected error on %s", self.name, message.topic)
            self.fault = exc
            return False
        return True

    def _handle(self, message: mqtt.MQTTMessage) -> None:
        if message.topic == round_topic(self.fleet):
            self.intake.hear(message.payload)
            self._heard.set()
        elif message.topic == collect_topic(self.fleet):
            self._answer(message.payload)
        else:
            decision = self.intake.offer(message.payload, topic=message.topic)
            # Committed by now: the receipt says so, and is queued before the update
            # is acknowledged.
            if decision.digest is not None:
                receipt = self.intake.receipt(decision)
                assert decision.client is not None
                self._publish(receipt_topic(self.fleet, decision.client), receipt.to_wire())
            elif decision.reason in REFUSALS:
                self._refuse(decision, message.payload)
            if self._on_update is not None:
                self._on_update(decision)

    def _refuse(self, decision: Decision, payload: bytes | bytearray) -> None:
        """Tell a device its updates are refused for good, once a round (as the single
        coordinator does: coordinator/service/service.py)."""
        assert decision.round is not None and decision.client is not None
        key = (decision.round, decision.client)
        refusal = None if key in self._told else self.intake.refusal(decision, payload)
        if refusal is None:
            return
        if len(self._told) >= 100_000:  # bounded: a flood of invented ids
            self._told.clear()
        self._told.add(key)
        self.link.publish(receipt_topic(self.fleet, decision.client), refusal.to_wire())

    def _answer(self, payload: bytes | bytearray) -> None:
        try:
            request = CollectRequest.from_wire(payload)
        except ProtocolError as exc:
            log.warning("worker %s: a malformed collect request (%s)", self.name, exc)
            return
        if request.fleet != self.fleet or not request.addressed_to(self.name):
            return
        answer = self.intake.collect(
            run=request.run, round_=request.round, exclude=request.exclude,
            retract=request.retract,
        )  # fmt: skip
        # Not awaited: this is paho's network thread. Behind the receipts queued before it.
        self._publish(partial_topic(self.fleet, self.name), answer.to_wire())


def serve(
    cfg: config_mod.CoordinatorConfig,
    *,
    name: str,
    group: str | None = None,
    db: Path | None = None,
    notifier: Notifier | None = None,
) -> int:
    """Run worker ``name`` until SIGTERM or SIGINT (0) or a storage fault (1), telling
    systemd READY=1 once subscribed, WATCHDOG=1 while :meth:`Worker.healthy` and
    STOPPING=1 on the way out (runtime/sdnotify.py; nothing outside systemd)."""
    notifier = notifier or Notifier()
    name = validate_id(name, field="name")
    store = WorkerStore(
        db or cfg.state_dir / f"worker-{name}.sqlite3", synchronous=cfg.sqlite_synchronous
    )
    intake = Intake(
        name=name,
        admission=cfg.admission_checks(),
        keys=CoordinatorKeys.load(cfg.security),
        store=store,
        max_payload_bytes=cfg.mqtt.max_payload_bytes,
    )
    stopping = threading.Event()
    # The main thread only waits on the event, with a timeout, so a Python handler runs
    # promptly here (runtime/lifecycle.py's dispatch thread is for loops that block).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    worker = Worker(
        intake=intake, group=group or cfg.workers.group, mqtt_settings=cfg.mqtt,
        group_sync=cfg.sqlite_synchronous == "GROUP",
    ).start()  # fmt: skip
    watchdog = Watchdog(notifier=notifier, healthy=worker.healthy)
    try:
        if not worker.wait_heard(10.0):
            log.warning("worker %s: no announcement retained on the round topic yet", name)
        log.info("worker %s ready", name)
        notifier.ready(f"worker {name} serving")
        watchdog.start()
        while not stopping.wait(1.0):
            if worker.fault is not None:
                return 1
        return 0
    finally:
        notifier.stopping()
        watchdog.stop()
        worker.stop()
        store.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.tier.worker",
        description="One coordinator worker on the fleet's shared update subscription.",
    )
    parser.add_argument("--config", "-c", type=Path, required=True, help="coordinator TOML")
    parser.add_argument("--name", required=True, help="this worker's id (its session too)")
    parser.add_argument("--group", help="the shared subscription group (default: [workers] group)")
    parser.add_argument("--db", type=Path, help="default: <state_dir>/worker-<name>.sqlite3")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    cfg = config_mod.load(args.config)
    return serve(cfg, name=args.name, group=args.group, db=args.db)


if __name__ == "__main__":
    sys.exit(main())
