"""An agent as a process against a real Mosquitto and a stand-in coordinator, through a
protocol upgrade: it says in its status when the fleet announces a version it does not
read (with the reason and the version), and answers a version-2 announcement in version 2,
so that a coordinator of the previous version counts it (docs/deploy.md, "Upgrading the
protocol")."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import msgpack
import numpy as np
import pytest

from export import bundle as bundle_mod
from protocol import (
    PrototypeUpdate,
    RoundAnnouncement,
    Status,
    TopicKind,
    parse_topic,
    round_topic,
    status_filter,
    update_filter,
)
from tests.agent_helpers import RUN, RUN_STARTED
from tests.mqtt_helpers import Collector, connected
from tests.process_helpers import agent_process, status
from tests.test_agent_service import CLASSES, write_config

pytestmark = pytest.mark.broker
T = TypeVar("T")


def _announcement(bundle_id: str, *, version: int) -> bytes:
    message = RoundAnnouncement(
        fleet="lab", round=0, run=RUN, run_started=RUN_STARTED, bundle=bundle_id,
        method="fedpcl", classes=CLASSES, dim=32, deadline=time.time() + 600,
        params={"final": False}, global_prototypes=np.zeros((0, 32), np.float32),
        wire_version=min(version, 3),
    )  # fmt: skip
    payload = message.to_wire()
    if version <= 3:
        return payload
    obj = msgpack.unpackb(payload)
    obj["v"] = version  # a version this device does not read, otherwise well formed
    return bytes(msgpack.packb(obj, use_bin_type=True))


def _wait(
    inbox: Collector, found: Callable[[], list[T]], what: str, timeout: float = 90.0
) -> list[T]:
    deadline = time.monotonic() + timeout
    while True:
        hit = found()
        if hit:
            return hit
        try:
            inbox.wait(len(inbox.messages) + 1, timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(f"no {what}") from None


@pytest.mark.slow
def test_an_agent_says_it_cannot_read_a_version_and_answers_version_2_in_version_2(
    mosquitto, small_zoo, tmp_path
):
    bundle_id = bundle_mod.load(small_zoo).id
    config, _ = write_config(
        tmp_path / "a", small_zoo, "dev-a", "clean", mosquitto.address.port, epochs=1
    )
    subscribe = (update_filter("lab"), status_filter("lab"))
    with connected(mosquitto.address, "stand-in", subscribe=subscribe) as (pub, inbox):

        def statuses() -> list[Status]:
            return [
                Status.from_wire(m.payload)
                for m in inbox.messages
                if parse_topic(m.topic).kind is TopicKind.STATUS
            ]

        def updates() -> list[bytes]:
            return [
                bytes(m.payload)
                for m in inbox.messages
                if parse_topic(m.topic).kind is TopicKind.UPDATE
            ]

        agent = agent_process(config)
        try:
            pub.publish(
                round_topic("lab"), _announcement(bundle_id, version=4), qos=1, retain=True
            ).wait_for_publish(10)
            said = _wait(
                inbox,
                lambda: [s for s in statuses() if s.reason.startswith("unsupported_version")],
                "status saying unsupported_version",
            )
            assert said[0].reason == (
                "unsupported_version: the fleet announces protocol version 4; this device "
                "reads 2 and 3"
            )
            assert not updates()
            # The coordinator of the previous version (or one announcing it through an
            # upgrade): answered in version 2, the reason taken back in a version-2 status.
            pub.publish(
                round_topic("lab"), _announcement(bundle_id, version=2), qos=1, retain=True
            ).wait_for_publish(10)
            (payload, *_) = _wait(inbox, updates, "an update")
            assert msgpack.unpackb(payload)["v"] == 2
            answer = PrototypeUpdate.from_wire(payload)
            assert answer.wire_version == 2 and answer.round == 0
            back = _wait(
                inbox,
                lambda: [s for s in statuses() if s.wire_version == 2 and s.reason == ""],
                "the reason taken back",
            )
            assert back[0].run == ""  # version 2 names no run
            assert agent.stop() == 0
        finally:
            agent.close()
    assert status("edge-agent", config)["ignored_announcements"]["unsupported_version"] >= 1
