"""A fleet upgrading from protocol version 2 to 3 one side at a time (docs/deploy.md,
"Upgrading the protocol"), against a real Mosquitto and a real coordinator process: a
version-2 device keeps contributing to a version-3 coordinator that announces version 2,
and a device that cannot read the announcements is named by the coordinator, in
``edge-coordinator status`` and in a metric, from what its status says."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from fleet.transports.broker import free_port
from protocol import AgentState, RoundAnnouncement, Status, round_topic, status_topic
from protocol.receipts import Receipt
from protocol.topics import receipt_topic
from tests.coordinator_helpers import coordinator_toml, stand_in_update
from tests.mqtt_helpers import connected
from tests.process_helpers import coordinator_process, status

pytestmark = pytest.mark.broker


def _config(tmp_path: Path, port: int, *, announce: int, metrics: int) -> Path:
    path = coordinator_toml(tmp_path, port, clients=2, rounds=1, allow_list=("dev-0", "dev-1"))
    text = path.read_text()
    extra = f"[protocol]\nannounce_version = {announce}\n[metrics]\nport = {metrics}\n"
    path.write_text(text + extra)
    return path


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)  # poll interval of a bounded wait on another process's state


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


@pytest.mark.slow
def test_a_version_2_device_is_counted_in_a_version_3_fleet(mosquitto, tmp_path):
    metrics = free_port()
    cfg = _config(tmp_path, mosquitto.address.port, announce=2, metrics=metrics)
    served = coordinator_process(cfg)
    subscribe = (round_topic("lab"), receipt_topic("lab", "dev-1"))
    try:
        with connected(mosquitto.address, "dev-1", subscribe=subscribe) as (pub, inbox):
            # What a version-2 device reads: an announcement without run, run_started, dim.
            inbox.wait(1)
            first = msgpack.unpackb(inbox.messages[0].payload)
            assert first["v"] == 2 and not {"run", "run_started", "dim"} & set(first)
            assert RoundAnnouncement.from_wire(inbox.messages[0].payload).round == 0
            # The version-2 device: its status and its update, both written in version 2,
            # and a version-3 device beside it.
            old = Status(fleet="lab", client="dev-1", state=AgentState.ONLINE, version="0.8.0",
                         wire_version=2)  # fmt: skip
            pub.publish(status_topic("lab", "dev-1"), old.to_wire(), qos=1, retain=True)
            v2_payload = _as_version_2(stand_in_update(1, 0).to_wire())
            pub.publish("protofleet/v1/lab/update/dev-1", v2_payload, qos=1).wait_for_publish(10)
            # Read while the coordinator serves: it ends once the round dev-0 completes closes.
            _wait(lambda: _metric(metrics, "protofleet_clients_previous_version") == 1.0,
                  "the version-2 device in the metric")  # fmt: skip
            pub.publish("protofleet/v1/lab/update/dev-0", stand_in_update(0, 0).to_wire(),
                        qos=1).wait_for_publish(10)  # fmt: skip

            def receipt() -> bytes | None:
                for m in inbox.messages:
                    if m.topic == receipt_topic("lab", "dev-1"):
                        return bytes(m.payload)
                return None

            _wait(lambda: receipt() is not None, "the version-2 device's receipt")
            raw = receipt()
            assert raw is not None and "run" not in msgpack.unpackb(raw)  # version 2's form
            assert Receipt.from_wire(raw).wire_version == 2

            def final() -> RoundAnnouncement | None:
                for m in inbox.messages:
                    if m.topic == round_topic("lab"):
                        a = RoundAnnouncement.from_wire(m.payload)
                        if a.round == 1:
                            return a
                return None

            _wait(lambda: final() is not None, "round 1")
            closed = final()
            assert closed is not None and set(closed.local_sets) == {"dev-0", "dev-1"}
        served.wait_for("final round")
    finally:
        served.close()
    shown = status("edge-coordinator", cfg)
    assert shown["previous_version"] == ["dev-1"]
    by_client = {c["client"]: c for c in shown["clients"]}
    assert by_client["dev-1"]["protocol"] == 2 and by_client["dev-1"]["updates_accepted"] == 1


def _as_version_2(payload: bytes) -> bytes:
    """An update as a version-2 encoder writes it: the same map with ``v = 2``, which the
    version-2 golden payload (tests/golden/v2/update.hex) shows is all that differs."""
    obj = msgpack.unpackb(payload)
    assert obj["v"] == 3
    obj["v"] = 2
    return bytes(msgpack.packb(obj, use_bin_type=True))


def test_a_device_that_cannot_read_the_announcements_is_named_in_status_and_metric(
    mosquitto, tmp_path
):
    metrics = free_port()
    cfg = _config(tmp_path, mosquitto.address.port, announce=3, metrics=metrics)
    served = coordinator_process(cfg)
    try:
        with connected(mosquitto.address, "dev-0") as (pub, _):
            # What an agent publishes when an announcement's version is not one it reads
            # (edge_agent/agent.py::Agent.unreadable; its own test: test_agent_versions.py).
            says = Status(
                fleet="lab", client="dev-0", state=AgentState.ONLINE, version="0.9.0",
                reason="unsupported_version: the fleet announces protocol version 4; this "
                "device reads 2 and 3",
            )  # fmt: skip
            pub.publish(status_topic("lab", "dev-0"), says.to_wire(), qos=1, retain=True)
            served.wait_for("client dev-0 cannot read this coordinator's announcements")
            _wait(
                lambda: _metric(metrics, "protofleet_clients_unsupported_version") == 1.0,
                "the metric",
            )
            shown = status("edge-coordinator", cfg)
            assert shown["unsupported_version"] == ["dev-0"]
            (client,) = [c for c in shown["clients"] if c["client"] == "dev-0"]
            assert "protocol version 4" in client["reason"]
    finally:
        served.close()
