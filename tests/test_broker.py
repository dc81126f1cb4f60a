"""Protocol messages through a real Mosquitto: retained rounds, QoS 1 updates."""

import socket
from pathlib import Path

import pytest

from fleet.transports import broker as broker_module
from fleet.transports.broker import (
    PRODUCTION_LIMITS,
    BrokerError,
    MosquittoBroker,
    find_mosquitto,
)
from protocol import (
    PrototypeUpdate,
    RoundAnnouncement,
    parse_topic,
    round_topic,
    update_filter,
    update_topic,
)
from tests import factories
from tests.mqtt_helpers import connected

pytestmark = pytest.mark.broker


def test_mosquitto_is_installed():
    # CI installs it; without it every broker test would be meaningless.
    assert find_mosquitto() is not None


def test_a_private_broker_has_the_limits_of_the_shipped_production_config():
    shipped = Path(__file__).resolve().parent.parent / "systemd" / "mosquitto" / "protofleet.conf"
    settings = dict(
        line.split(None, 1) for line in shipped.read_text().splitlines() if line.strip()
        and not line.startswith("#")
    )  # fmt: skip
    assert {k: int(settings[k]) for k in PRODUCTION_LIMITS} == PRODUCTION_LIMITS
    text = MosquittoBroker(port=1).config_text()
    assert all(f"{k} {v}\n" in text for k, v in PRODUCTION_LIMITS.items())
    # Mosquitto's default of 1000 queued messages drops a burst of updates silently.
    assert PRODUCTION_LIMITS["max_queued_messages"] > 1000


def test_retained_round_reaches_a_late_subscriber(mosquitto):
    announcement = factories.announcement()
    with connected(mosquitto.address, "coordinator") as (pub, _):
        info = pub.publish(round_topic("lab"), announcement.to_wire(), qos=1, retain=True)
        info.wait_for_publish(10)
    with connected(mosquitto.address, "late-agent", subscribe=(round_topic("lab"),)) as (_, inbox):
        (message,) = inbox.wait(1)
    assert message.retain
    assert RoundAnnouncement.from_wire(message.payload) == announcement


def test_updates_arrive_on_the_fleet_filter(mosquitto):
    with connected(mosquitto.address, "coordinator", subscribe=(update_filter("lab"),)) as (
        _,
        inbox,
    ):
        with connected(mosquitto.address, "agent") as (pub, _):
            for client in ("d1", "d2"):
                update = factories.update(client=client)
                pub.publish(update_topic("lab", client), update.to_wire(), qos=1).wait_for_publish(
                    10
                )
        messages = inbox.wait(2)
    got = {parse_topic(m.topic).client: PrototypeUpdate.from_wire(m.payload) for m in messages}
    assert got == {"d1": factories.update(client="d1"), "d2": factories.update(client="d2")}


def test_a_broken_config_is_reported_with_the_broker_log():
    broker = MosquittoBroker(extra_config="no_such_option 1\n", startup_timeout=5)
    with pytest.raises(BrokerError, match=r"no_such_option|exited"):
        broker.start()


def test_a_port_taken_by_another_listener_is_not_mistaken_for_the_broker(monkeypatch):
    """Another process listening on the picked port answers a connection at once; the
    broker must not be taken as started then: a port it chose is given up for another,
    a port it was given is an error naming it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {busy} is in use"):
            MosquittoBroker(port=busy, startup_timeout=5).start()
        picks = iter([busy, broker_module.free_port()])
        monkeypatch.setattr(broker_module, "free_port", lambda host="127.0.0.1": next(picks))
        with MosquittoBroker(startup_timeout=5) as moved:
            assert moved.address.port != busy
            with connected(moved.address, "probe") as (client, _):
                assert client.is_connected()
