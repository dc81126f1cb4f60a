"""Deployment: unit files, installers, the services' systemd life cycle, and a fleet over
the shipped TLS broker configuration with certificates from make-certs.sh."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from export.bundle import load as load_bundle
from fleet.transports.broker import BrokerAddress, MosquittoBroker, free_port
from protocol import AgentState, Status, round_topic, status_topic, update_topic
from runtime.transport import CredentialsError, MqttSettings, load_credentials
from tests.agent_helpers import digits_npz
from tests.process_helpers import BIN, agent_process, coordinator_process
from tests.test_sdnotify import NotifySocket

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "systemd"
CLASSES = '["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]'


def sh(*args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
    result = subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})},
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{args[0]} exited {result.returncode}:\n{result.stderr}")
    return result.stdout + result.stderr


# -- installers and unit files -------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs") / "fleet"
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(out), "--broker-name", "localhost",
       "coordinator", "dev-a", "dev-b", "dev-revoked")  # fmt: skip
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(out), "--revoke", "dev-revoked")
    return out


@pytest.mark.slow
def test_installers_stage_the_expected_tree_and_units_verify(tmp_path: Path, certs: Path) -> None:
    stage = tmp_path / "stage"
    env = {"DESTDIR": str(stage), "PROTOFLEET_TEGRA_RELEASE": str(tmp_path / "none")}
    out = sh(str(SYSTEMD / "install-agent.sh"), "--no-deps", env=env)
    assert "not a Jetson" in out
    sh(
        str(SYSTEMD / "install-coordinator.sh"),
        "--no-deps",
        "--with-mosquitto",
        "--certs",
        str(certs),
        env=env,
    )
    expected = [
        "opt/protofleet/venv/bin/edge-agent",
        "opt/protofleet/venv/bin/edge-coordinator",
        "etc/systemd/system/edge-agent.service",
        "etc/systemd/system/edge-coordinator.service",
        "etc/protofleet/agent.toml",
        "etc/protofleet/coordinator.toml",
        "etc/protofleet/coordinator.crt",
        "etc/protofleet/coordinator.key",
        # Enrolled for signed updates: the device certificates, not the coordinator's own.
        "etc/protofleet/devices/dev-a.crt",
        "etc/protofleet/devices/dev-b.crt",
        "etc/mosquitto/conf.d/protofleet.conf",
        "etc/mosquitto/protofleet/acl",
        "etc/mosquitto/protofleet/ca.crt",
        "etc/mosquitto/protofleet/crl.pem",
        "etc/mosquitto/protofleet/broker.key",
        "opt/protofleet/share/doc/protofleet/deploy.md",
    ]
    assert [p for p in expected if not (stage / p).exists()] == []
    assert (stage / "etc/mosquitto/protofleet/broker.key").stat().st_mode & 0o077 == 0
    enrolled = sorted(p.name for p in (stage / "etc/protofleet/devices").iterdir())
    assert enrolled == ["dev-a.crt", "dev-b.crt"]  # not the coordinator, not dev-revoked
    # The console script belongs to the staged venv (its dependencies are not installed
    # here: --no-deps), and the package inside it is this checkout's.
    script = (stage / "opt/protofleet/venv/bin/edge-agent").read_text()
    assert script.startswith(f"#!{stage}/opt/protofleet/venv/bin/python")
    site = next((stage / "opt/protofleet/venv/lib").glob("python3*/site-packages"))
    assert (site / "edge_agent" / "cli.py").read_text() == (
        ROOT / "edge_agent" / "cli.py"
    ).read_text()

    units = stage / "etc/systemd/system"
    for name in ("edge-agent", "edge-coordinator"):
        text = (units / f"{name}.service").read_text()
        assert "@PREFIX@" not in text
        assert f"ExecStart=/opt/protofleet/venv/bin/{name} " in text
        assert "Type=notify" in text and "WatchdogSec=" in text
        # systemd-analyze checks that ExecStart exists: point it at the staged tree.
        (units / f"{name}.service").write_text(
            text.replace("/opt/protofleet", f"{stage}/opt/protofleet")
        )
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (CI installs Debian's systemd)")
    result = subprocess.run(
        [
            analyze,
            "verify",
            str(units / "edge-agent.service"),
            str(units / "edge-coordinator.service"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr

    # A second run keeps an edited configuration.
    out = sh(str(SYSTEMD / "install-agent.sh"), "--no-deps", "--dry-run", env=env)
    assert f"kept the existing {stage}/etc/protofleet/agent.toml" in out


# -- life cycle under systemd ----------------------------------------------------------------


def coordinator_toml(
    path: Path,
    *,
    port: int,
    bundle: str,
    extra_mqtt: str = "",
    security: str = "insecure = true\n",
    **rounds: object,
) -> Path:
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in rounds.items())
    path.write_text(
        f'fleet = "lab"\nstate_dir = "{path.parent / "coord"}"\n'
        f'[model]\nmethod = "fedpcl"\nbundle = "{bundle}"\nclasses = {CLASSES}\ndim = 32\n'
        f"[rounds]\nmin_clients = 1\nwait_after_quorum_s = 0.0\n{lines}"
        f'[mqtt]\nhost = "127.0.0.1"\nport = {port}\n{extra_mqtt}'
        f"[security]\n{security}"
    )
    return path


def scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


@pytest.mark.slow
@pytest.mark.broker
def test_coordinator_notifies_systemd_reloads_on_sighup_and_stops_on_sigterm(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    config = coordinator_toml(
        tmp_path / "coordinator.toml", port=mosquitto.address.port, bundle="f" * 64, timeout_s=300.0
    )
    metrics_before, metrics_after = free_port(), free_port()
    with config.open("a") as f:
        f.write(f'[metrics]\nhost = "127.0.0.1"\nport = {metrics_before}\n')
    proc = coordinator_process(
        config, env={"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": "400000"}
    )
    try:
        notify.wait_for("READY=1")
        notify.wait_for("WATCHDOG=1")
        notify.wait_for("WATCHDOG=1")
        assert "protofleet_current_round 0.0" in scrape(metrics_before)

        # A reload applies every setting, the metrics address too.
        text = config.read_text()
        text = text.replace("timeout_s = 300.0", "timeout_s = 600.0")
        config.write_text(text.replace(f"port = {metrics_before}", f"port = {metrics_after}"))
        seen = len(proc.lines)
        proc.signal(signal.SIGHUP)
        notify.wait_for("RELOADING=1")
        notify.wait_for("READY=1")
        proc.wait_for("configuration reloaded", after=seen)
        assert "protofleet_current_round 0.0" in scrape(metrics_after)
        with pytest.raises(urllib.error.URLError):
            scrape(metrics_before)

        config.write_text("fleet = \n")  # broken TOML: refused, the old one keeps serving
        seen = len(proc.lines)
        proc.signal(signal.SIGHUP)
        notify.wait_for("READY=1")
        proc.wait_for("reload refused", after=seen)
        assert proc.proc.poll() is None

        # A metrics address taken by another program: refused, the endpoint stays put.
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = taken.getsockname()[1]
            config.write_text(text.replace(f"port = {metrics_before}", f"port = {busy}"))
            seen = len(proc.lines)
            proc.signal(signal.SIGHUP)
            notify.wait_for("READY=1")
            proc.wait_for("reload refused", after=seen)
        refused = "".join(proc.lines[seen:])
        assert f"cannot serve metrics on 127.0.0.1:{busy}: Address already in use" in refused
        assert "protofleet_current_round 0.0" in scrape(metrics_after)

        proc.signal(signal.SIGTERM)
        try:
            notify.wait_for("STOPPING=1")
        except TimeoutError:
            print("".join(proc.lines), proc.proc.poll())
            raise
        assert proc.proc.wait(timeout=30) == 0
    finally:
        proc.close()
        notify.sock.close()


# -- the shipped broker configuration over TLS -------------------------------------------------


def shipped_broker(certs: Path, tmp_path: Path) -> MosquittoBroker:
    """Mosquitto with systemd/mosquitto/protofleet.conf, only paths and port rewritten."""
    port = free_port()
    live = tmp_path / "mosquitto"
    shutil.copytree(certs, live / "certs", ignore=shutil.ignore_patterns("ca", "clients"))
    shutil.copy(SYSTEMD / "mosquitto" / "acl", live / "certs" / "acl")
    (live / "data").mkdir()
    text = (SYSTEMD / "mosquitto" / "protofleet.conf").read_text()
    assert "listener 8883\n" in text
    text = (
        text.replace("listener 8883\n", f"listener {port} 127.0.0.1\n")
        .replace("/etc/mosquitto/protofleet/", f"{live}/certs/")
        .replace("/var/lib/mosquitto/", f"{live}/data/")
    )
    if os.geteuid() == 0:
        # Started as root, mosquitto drops to its own user, who cannot enter pytest's
        # private temporary directories; docs/deploy.md gives the real install's owners.
        text += "user root\n"
    return MosquittoBroker(port=port, config=text + "log_dest stderr\nlog_type all\n")


def tls_client(
    broker: BrokerAddress, client_id: str, ca: Path, cert: Path | None
) -> tuple[mqtt.Client, mqtt.ReasonCode | None, list[mqtt.MQTTMessage], threading.Condition]:
    """Connect and return (client, CONNACK reason or None if the TLS handshake failed,
    received messages, their condition)."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(cert.with_suffix(".key")))
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    client.tls_set_context(context)
    cond = threading.Condition()
    messages: list[mqtt.MQTTMessage] = []
    outcome: list[mqtt.ReasonCode | None] = []

    def on_connect(c, u, flags, reason, props):
        with cond:
            outcome.append(reason)
            cond.notify_all()

    def on_message(c, u, message):
        with cond:
            messages.append(message)
            cond.notify_all()

    closed = threading.Event()

    def on_disconnect(c, u, flags, reason, props):
        # A broker that refuses a certificate after a TLS 1.3 handshake closes the socket
        # without a CONNACK: waiting for one would only run out the timeout.
        with cond:
            closed.set()
            cond.notify_all()

    client.on_connect = on_connect
    client.on_message = on_message
    client.on_disconnect = on_disconnect
    try:
        client.connect(broker.host, broker.port)
    except (ssl.SSLError, OSError):
        return client, None, messages, cond
    client.loop_start()
    with cond:
        cond.wait_for(lambda: outcome or closed.is_set(), timeout=10)
    if not outcome or not client.is_connected():
        client.loop_stop()
        return client, outcome[0] if outcome else None, messages, cond
    return client, outcome[0], messages, cond


def refused(broker: BrokerAddress, ca: Path, cert: Path | None) -> bool:
    client, reason, _, _ = tls_client(broker, "intruder", ca, cert)
    ok = reason is not None and not reason.is_failure and client.is_connected()
    if ok:
        client.disconnect()
        client.loop_stop()
    return not ok


def subscribe(client: mqtt.Client, topic: str) -> list[mqtt.ReasonCode]:
    done = threading.Event()
    codes: list[mqtt.ReasonCode] = []

    def on_subscribe(c, u, mid, reason_codes, props):
        codes.extend(reason_codes)
        done.set()

    client.on_subscribe = on_subscribe
    client.subscribe(topic, qos=1)
    assert done.wait(10), "no SUBACK"
    return codes


def test_broker_files_are_read_once_up_front_and_a_wrong_pair_is_named(certs: Path) -> None:
    clients = certs / "clients"
    settings = MqttSettings(
        tls_ca=certs / "ca.crt", tls_cert=clients / "dev-a.crt", tls_key=clients / "dev-a.key",
        tls_insecure=True,
    )  # fmt: skip
    credentials = load_credentials(settings)
    assert credentials.password is None and credentials.tls is not None
    assert not credentials.tls.check_hostname  # tls_insecure
    # The CA alone is trusted: the system's store is not added beside a private CA.
    assert [c["subject"] for c in credentials.tls.get_ca_certs()] == [
        c["subject"]
        for c in ssl.create_default_context(cafile=str(certs / "ca.crt")).get_ca_certs()
    ]
    wrong_key = replace(settings, tls_key=clients / "dev-b.key")
    with pytest.raises(CredentialsError, match=r"mqtt\.tls_cert .*dev-a\.crt: not a usable PEM"):
        load_credentials(wrong_key)
    with pytest.raises(CredentialsError, match=r"mqtt\.tls_key .*missing\.key: No such file"):
        load_credentials(replace(settings, tls_key=clients / "missing.key"))


@pytest.mark.broker
def test_a_broker_certificate_the_coordinator_does_not_trust_is_logged_as_such(
    certs: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A wrong tls_ca used to read "cannot reach the broker", like a broker that is down.
    other = tmp_path_factory.mktemp("stranger") / "ca"
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(other), "coordinator")
    with shipped_broker(certs, tmp_path) as broker:
        tls = (
            f'tls_ca = "{other / "ca.crt"}"\ntls_cert = "{other / "clients" / "coordinator.crt"}"\n'
            f'tls_key = "{other / "clients" / "coordinator.key"}"\n'
        )
        config = coordinator_toml(
            tmp_path / "coordinator.toml", port=broker.address.port, bundle="b", extra_mqtt=tls
        )
        coordinator = coordinator_process(config)
        try:
            coordinator.wait_for(
                f"cannot reach the broker at 127.0.0.1:{broker.address.port} (its TLS "
                "certificate is not trusted: self-signed certificate in certificate chain); retrying"
            )
        finally:
            coordinator.close()


@pytest.mark.slow
@pytest.mark.broker
def test_a_fleet_over_the_shipped_tls_config(
    certs: Path, small_zoo: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other_ca = tmp_path_factory.mktemp("other") / "ca"
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(other_ca), "dev-a")
    ca = certs / "ca.crt"
    clients = certs / "clients"
    bundle_id = load_bundle(small_zoo).id

    with shipped_broker(certs, tmp_path) as broker:
        address = broker.address
        tls = (
            f'tls_ca = "{ca}"\ntls_cert = "{clients / "coordinator.crt"}"\n'
            f'tls_key = "{clients / "coordinator.key"}"\n'
        )
        coord_cfg = coordinator_toml(
            tmp_path / "coordinator.toml", port=address.port, bundle=bundle_id, extra_mqtt=tls,
            # One identity serves TLS and signing: make-certs.sh's keys and certificates.
            security=f'key = "{clients / "coordinator.key"}"\ndevices = "{clients}"\n',
            max_rounds=1, timeout_s=120.0,
        )  # fmt: skip
        agent_dir = tmp_path / "dev-a"
        agent_dir.mkdir()
        train = digits_npz(agent_dir, "clean", start=0, count=100)
        agent_cfg = agent_dir / "agent.toml"
        agent_cfg.write_text(
            f'agent_id = "dev-a"\nfleet = "lab"\nstate_dir = "{agent_dir / "state"}"\n'
            f'bundle = "{small_zoo}"\n[data]\ntrain = "{train}"\n[train]\nout_dim = 32\n'
            f'[mqtt]\nhost = "127.0.0.1"\nport = {address.port}\ntls_ca = "{ca}"\n'
            f'tls_cert = "{clients / "dev-a.crt"}"\ntls_key = "{clients / "dev-a.key"}"\n'
            f'[security]\nkey = "{clients / "dev-a.key"}"\n'
            f'coordinator = "{clients / "coordinator.crt"}"\n'
        )
        notify = NotifySocket(str(tmp_path / "agent-notify.sock"))
        coordinator = coordinator_process(coord_cfg)
        agent = agent_process(agent_cfg, env={"NOTIFY_SOCKET": notify.address})
        try:
            notify.wait_for("READY=1")
            # The receipt passes the ACL: the device hears that its update was stored.
            agent.wait_for("round 0: update stored by the coordinator", timeout=120)
            coordinator.wait_for("round 0 closed with 1 update(s) from dev-a", timeout=60)
            assert coordinator.proc.wait(timeout=60) == 0  # max_rounds reached

            # Refused: no certificate, a certificate from another CA, a revoked one.
            assert refused(address, ca, None)
            assert refused(address, ca, other_ca / "clients" / "dev-a.crt")
            assert refused(address, ca, clients / "dev-revoked.crt")

            # The coordinator's identity reads every update; device B may not write
            # device A's update topic.
            watcher, reason, seen, cond = tls_client(
                address, "watcher", ca, clients / "coordinator.crt"
            )
            assert reason is not None and not reason.is_failure
            subscribe(watcher, "protofleet/v1/lab/update/+")
            dev_b, reason, b_seen, b_cond = tls_client(address, "dev-b", ca, clients / "dev-b.crt")
            assert reason is not None and not reason.is_failure
            dev_b.publish(update_topic("lab", "dev-a"), b"forged", qos=1).wait_for_publish(10)
            dev_b.publish(update_topic("lab", "dev-b"), b"marker", qos=1).wait_for_publish(10)
            with cond:
                assert cond.wait_for(lambda: any(m.payload == b"marker" for m in seen), timeout=10)
            # Per-client ordering: the forged message would have arrived before the marker.
            assert [m.payload for m in seen] == [b"marker"]

            # Device B subscribing to '#' gets nothing but the round topic: Mosquitto's ACL
            # file filters delivery (it grants the SUBACK), so the proof is what arrives.
            subscribe(dev_b, "#")
            dev_a, reason, _, _ = tls_client(address, "dev-a-probe", ca, clients / "dev-a.crt")
            assert reason is not None and not reason.is_failure
            dev_a.publish(update_topic("lab", "dev-a"), b"secret", qos=1).wait_for_publish(10)
            with cond:
                assert cond.wait_for(lambda: any(m.payload == b"secret" for m in seen), timeout=10)
            # Routed to every subscriber already; now something B may read, as a marker.
            watcher.publish(round_topic("lab"), b"round-marker", qos=1).wait_for_publish(10)
            with b_cond:
                assert b_cond.wait_for(
                    lambda: any(m.payload == b"round-marker" for m in b_seen), timeout=10
                )
            assert {m.topic for m in b_seen} == {round_topic("lab")}
            assert not any(m.payload in (b"secret", b"marker") for m in b_seen)

            # SIGTERM: STOPPING=1, a clean exit and a retained offline status.
            assert agent.stop() == 0
            notify.wait_for("STOPPING=1")
            subscribe(watcher, status_topic("lab", "dev-a"))
            with cond:
                assert cond.wait_for(
                    lambda: any(m.topic == status_topic("lab", "dev-a") for m in seen), timeout=10
                )
            status = Status.from_wire(
                next(m.payload for m in seen if m.topic == status_topic("lab", "dev-a"))
            )
            assert status.state is AgentState.OFFLINE and status.reason == "shutdown"
            assert status.last_round == 0
            for client in (watcher, dev_b, dev_a):
                client.disconnect()
                client.loop_stop()
        finally:
            agent.close()
            coordinator.close()
            notify.sock.close()
