"""Revoking a device (``make-certs.sh --revoke``) takes it out at once: the coordinator
rejects its updates from its next reload (SIGHUP), the broker refuses it once restarted,
and the device's log says plainly that the broker refuses it. Over a real Mosquitto with
the shipped TLS configuration and certificates from make-certs.sh."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.transports.broker import BrokerAddress, MosquittoBroker
from protocol import update_filter, update_topic
from protocol.auth import sign, signature_problem
from protocol.receipts import Receipt, payload_digest
from protocol.topics import receipt_topic
from runtime.keyfiles import load_signer
from runtime.mqtt_client import Reconnect, certificate_refusal
from runtime.mqtt_link import MqttLink
from runtime.transport import MqttSettings
from tests.coordinator_helpers import coordinator_toml, stand_in_update, stand_ins
from tests.mqtt_helpers import connected
from tests.process_helpers import coordinator_process, status
from tests.test_deploy import SYSTEMD, sh, shipped_broker, subscribe, tls_client
from tests.test_mqtt_link import Lines, attached_lines

pytestmark = pytest.mark.broker


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A fleet CA with the coordinator, dev-0 and dev-1; nobody revoked yet."""
    out = tmp_path / "fleet"
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(out), "--broker-name", "localhost",
       "coordinator", "dev-0", "dev-1")  # fmt: skip
    return out


def revoke(certs: Path, name: str) -> None:
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(certs), "--revoke", name)


@pytest.fixture
def lines(request: pytest.FixtureRequest) -> Iterator[Lines]:
    # From DEBUG: the refusals between the logged ones are DEBUG lines.
    yield from attached_lines(request, prefix="tests.revocation", level=logging.DEBUG)


def device_link(
    address: BrokerAddress, certs: Path, name: str, lines: Lines, *, max_s: float = 1.0
) -> MqttLink:
    """A device's link with its make-certs.sh certificate; waits of 1 s unless ``max_s``."""
    clients = certs / "clients"
    settings = MqttSettings(
        host=address.host, port=address.port, tls_ca=certs / "ca.crt",
        tls_cert=clients / f"{name}.crt", tls_key=clients / f"{name}.key",
        reconnect_min_s=1.0, reconnect_max_s=max_s,
    )  # fmt: skip
    return MqttLink(
        settings=settings, client_id=name, subscriptions=(), on_connected=lambda: None,
        on_message=lambda m: True, reconnect=Reconnect(jittered=True), logger=lines.logger,
        rng=random.Random(7),
    )  # fmt: skip


def live_crl(broker_dir: Path, certs: Path) -> None:
    """Install make-certs.sh's CRL where the running broker reads it."""
    shutil.copy(certs / "crl.pem", broker_dir / "mosquitto" / "certs" / "crl.pem")


@pytest.mark.slow
def test_a_revoked_device_is_told_it_is_refused_once_and_then_seldom(certs, tmp_path, lines):
    revoke(certs, "dev-1")
    with shipped_broker(certs, tmp_path) as broker:
        device = device_link(broker.address, certs, "dev-1", lines)
        device.start()
        try:
            refusals = lines.wait("broker refused the connection", count=4)
        finally:
            device.close()
        assert not device.is_connected()
        # The shipped broker's TLS 1.2 is a minimum: the device negotiates TLS 1.3, whose
        # refusal comes without a reason, and asks for it in a TLS 1.2 handshake.
        why = (
            f"this client's certificate mqtt.tls_cert {certs / 'clients' / 'dev-1.crt'} is revoked"
        )
        assert [(r.levelno, r.getMessage()) for r in refusals] == [
            (logging.ERROR, f"broker refused the connection: {why}; it refuses it again until "
             "that is fixed (next attempt in 1 s)"),
            (logging.ERROR, f"broker refused the connection again (2 times in a row): {why}; "
             "next attempt in 1 s"),
            (logging.DEBUG, f"broker refused the connection again (3 times in a row): {why}; "
             "next attempt in 1 s"),
            (logging.ERROR, f"broker refused the connection again (4 times in a row): {why}; "
             "next attempt in 1 s"),
        ]  # fmt: skip
        assert not any("Unspecified error" in line for line in lines.lines)

        # With [mqtt]'s default waits a refused device tries again after 30 to 60 s, not 2.
        patient = device_link(broker.address, certs, "dev-1", lines, max_s=60.0)
        patient.start()
        try:
            first = lines.wait("broker refused the connection", count=5)[-1].getMessage()
        finally:
            patient.close()
        wait = int(first.rsplit("next attempt in ", 1)[1].split(" ")[0])
        assert 30 <= wait <= 60, first

        # Over TLS 1.2 the broker says why in the handshake, and so does the device.
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        context.load_cert_chain(certs / "clients" / "dev-1.crt", certs / "clients" / "dev-1.key")
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        with (
            socket.create_connection((broker.address.host, broker.address.port)) as raw,
            pytest.raises(ssl.SSLError) as alert,
        ):
            context.wrap_socket(raw, server_hostname="localhost")
        assert certificate_refusal(alert.value, device.settings) == (
            f"this client's certificate mqtt.tls_cert {certs / 'clients' / 'dev-1.crt'} is revoked"
        )


def revoked_in_handshake(address: BrokerAddress, certs: Path, name: str) -> bool:
    """Whether the broker refuses ``name``'s certificate as revoked now (TLS 1.2: in the handshake,
    before any MQTT packet, so a connected client of that name is not taken over)."""
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.load_cert_chain(certs / "clients" / f"{name}.crt", certs / "clients" / f"{name}.key")
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection((address.host, address.port)) as raw:
        try:
            context.wrap_socket(raw, server_hostname="localhost").close()
        except ssl.SSLError as exc:
            return (exc.reason or "").endswith("ALERT_CERTIFICATE_REVOKED")
    return False


def wait_for_log(broker: MosquittoBroker, text: str, *, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in broker.log_path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"mosquitto did not log {text!r} in {timeout} s")
        time.sleep(0.05)  # poll interval of a bounded wait on another process's log


@pytest.mark.slow
def test_a_connected_revoked_device_is_cut_off_by_restarting_the_broker(certs, tmp_path, lines):
    broker = shipped_broker(certs, tmp_path)
    with broker:
        kept = device_link(broker.address, certs, "dev-0", lines)
        revoked = device_link(broker.address, certs, "dev-1", lines)
        for link in (kept, revoked):
            link.start()
            assert link.wait_connected(10)
        watcher, reason, seen, cond = tls_client(
            broker.address, "coordinator", certs / "ca.crt", certs / "clients" / "coordinator.crt"
        )
        assert reason is not None and not reason.is_failure
        subscribe(watcher, update_filter("lab"))

        revoke(certs, "dev-1")
        live_crl(tmp_path, certs)
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGHUP)  # what the docs said: reload mosquitto
        wait_for_log(broker, "Reloading config")
        # The reload took the new CRL: dev-1 cannot connect again...
        assert revoked_in_handshake(broker.address, certs, "dev-1")
        assert not revoked_in_handshake(broker.address, certs, "dev-0")
        # ...but the connected dev-1 is not cut off: its update still reaches the coordinator.
        assert revoked.is_connected()
        revoked.publish(update_topic("lab", "dev-1"), b"after the reload").wait_for_publish(10)
        with cond:
            assert cond.wait_for(
                lambda: any(m.payload == b"after the reload" for m in seen), timeout=10
            )
        watcher.disconnect()
        watcher.loop_stop()

        # What works: restart the broker. Every client reconnects; dev-1 is refused.
        broker.stop()
        broker.start()
        assert kept.wait_connected(30)
        refusal = lines.wait("broker refused the connection")[0].getMessage()
        assert "dev-1.crt is revoked" in refusal
        assert not revoked.is_connected()
        for link in (kept, revoked):
            link.close()


def signed_coordinator(tmp_path: Path, port: int, certs: Path) -> Path:
    """A coordinator of dev-0 and dev-1 (quorum 2) enrolled by make-certs.sh's certificates,
    with the fleet CA and its CRL, as coordinator.toml's example has them."""
    devices = tmp_path / "devices"
    devices.mkdir()
    for name in ("dev-0", "dev-1"):
        shutil.copy(certs / "clients" / f"{name}.crt", devices)
    config = coordinator_toml(tmp_path, port, clients=2, rounds=3)
    text = config.read_text().replace(
        "insecure = true",
        f'key = "{certs / "clients" / "coordinator.key"}"\ndevices = "{devices}"\n'
        f'ca = "{certs / "ca.crt"}"\ncrl = "{certs / "crl.pem"}"',
    )
    config.write_text(text)
    return config


@pytest.mark.slow
def test_the_coordinator_rejects_a_revoked_device_from_its_reload_on(mosquitto, certs, tmp_path):
    config = signed_coordinator(tmp_path, mosquitto.address.port, certs)
    signers = {n: load_signer(certs / "clients" / f"{n}.key") for n in ("dev-0", "dev-1")}
    coordinator = coordinator_process(config)
    try:
        with stand_ins(mosquitto) as fleet:
            run = fleet.run()
            fleet.send([sign(stand_in_update(i, 0), signers[f"dev-{i}"], run=run) for i in (0, 1)])
            fleet.announcement(1)  # both counted in round 0

            revoke(certs, "dev-1")  # rewrites crl.pem, the file security.crl names
            seen = len(coordinator.lines)
            coordinator.signal(signal.SIGHUP)
            coordinator.wait_for("not enrolling dev-1: its certificate", after=seen)
            coordinator.wait_for("rounds.min_clients = 2 exceeds the 1 device(s)", after=seen)
            coordinator.wait_for("configuration reloaded", after=seen)

            # dev-1's signed round-1 update is rejected, and dev-1 told so in a signed
            # refusal (it would resend every 10 s otherwise); dev-0's, sent after it, is
            # stored (the coordinator takes one connection's updates in order).
            topics = (receipt_topic("lab", "dev-0"), receipt_topic("lab", "dev-1"))
            with connected(mosquitto.address, "receipts", subscribe=topics) as (_, receipts):
                sent = [sign(stand_in_update(i, 1), signers[f"dev-{i}"], run=run) for i in (1, 0)]
                fleet.send(sent)
                fleet.send(sent[:1])  # a resend: told once a round, not once a copy
                receipts.wait(2)
                fleet.send(sent[1:])  # a duplicate of dev-0's, answered after the resend
                receipts.wait(3)
            answers = {m.topic: Receipt.from_wire(m.payload) for m in receipts.messages}
            refusal = answers[topics[1]]
            assert [m.topic for m in receipts.messages].count(topics[1]) == 1
            assert refusal.refused == "revoked" and refusal.round == 1
            assert refusal.digest == payload_digest(sent[0].to_wire())
            coordinator_key = load_signer(certs / "clients" / "coordinator.key").public
            assert signature_problem(refusal, coordinator_key, run=run) is None
            assert answers[topics[0]].refused == ""
        assert coordinator.stop() == 0
    finally:
        coordinator.close()
    shown = status("edge-coordinator", config)
    assert shown["rejections"] == {"revoked": 2, "duplicate": 1}
