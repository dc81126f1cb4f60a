"""Two agents as separate processes, a real Mosquitto and a stand-in coordinator."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from export import bundle as bundle_mod
from fleet.transports.broker import MosquittoBroker, free_port
from protocol import (
    AgentState,
    PrototypeUpdate,
    RoundAnnouncement,
    Status,
    TopicKind,
    parse_topic,
    round_topic,
    status_filter,
    status_topic,
    update_filter,
)
from protocol.receipts import Receipt, payload_digest
from protocol.topics import receipt_topic
from runtime.transport import wait_acknowledged
from tests.agent_helpers import RUN, RUN_STARTED, digits_npz
from tests.mqtt_helpers import connected
from tests.process_helpers import agent_process, status

pytestmark = pytest.mark.broker

BIN = Path(sys.executable).parent
CLASSES = tuple(str(i) for i in range(10))


def write_config(
    root: Path, bundle: Path, agent_id: str, domain: str, port: int, *, epochs: int
) -> tuple[Path, np.ndarray]:
    root.mkdir(parents=True)
    train = digits_npz(root, domain, start=0, count=200)
    config = root / "agent.toml"
    config.write_text(
        f'agent_id = "{agent_id}"\nfleet = "lab"\nstate_dir = "{root / "state"}"\nbundle = "{bundle}"\n'
        f'[data]\ntrain = "{train}"\n[train]\nout_dim = 32\nepochs = {epochs}\n[mqtt]\nport = {port}\n'
        # Signatures have their tests (test_signatures.py); these are about other things.
        "[security]\ninsecure = true\n"
    )
    with np.load(train) as data:
        return config, data["y"]


class StandInCoordinator:
    """Announces rounds and, like the coordinator, answers every update with a receipt
    (``receipts=False``: never, as a coordinator that lost them; ``refused``: with a
    refusal for that reason, as the coordinator answers a revoked device)."""

    def __init__(
        self, pub, inbox, bundle_id: str, *, receipts: bool = True, refused: str = ""
    ) -> None:
        self.pub, self.inbox, self.bundle_id = pub, inbox, bundle_id
        self.receipts = receipts

        def on_message(client, userdata, message) -> None:
            inbox.on_message(client, userdata, message)
            topic = parse_topic(message.topic)
            if self.receipts and topic.kind is TopicKind.UPDATE:
                update = PrototypeUpdate.from_wire(message.payload)
                receipt = Receipt(
                    fleet="lab",
                    round=update.round,
                    run=RUN,
                    client=update.client,
                    digest=payload_digest(message.payload),
                    refused=refused,
                )
                client.publish(receipt_topic("lab", update.client), receipt.to_wire(), qos=1)

        pub.on_message = on_message

    def announce(self, round_: int, updates: list[PrototypeUpdate]) -> None:
        # Globals as the plain mean of the received prototypes: enough to exercise the
        # agents' use of an announcement.
        rows: dict[int, list[np.ndarray]] = {}
        for u in updates:
            for c, p in zip(u.classes, u.prototypes, strict=True):
                rows.setdefault(c, []).append(p.astype(np.float32))
        classes = tuple(sorted(rows))
        protos = (
            np.stack([np.mean(rows[c], axis=0) for c in classes])
            if classes
            else np.zeros((0, 0), np.float32)
        )
        ann = RoundAnnouncement(
            fleet="lab",
            round=round_,
            run=RUN,
            run_started=RUN_STARTED,
            bundle=self.bundle_id,
            method="fedpcl",
            classes=CLASSES,
            dim=32,
            deadline=time.time() + 600,
            params={"final": False},
            global_classes=classes,
            global_prototypes=protos.astype(np.float32),
        )
        self.pub.publish(round_topic("lab"), ann.to_wire(), qos=1, retain=True).wait_for_publish(10)

    def updates(self) -> list[tuple[str | None, PrototypeUpdate]]:
        out = []
        for m in self.inbox.messages:
            topic = parse_topic(m.topic)
            if topic.kind.value == "update":
                out.append((topic.client, PrototypeUpdate.from_wire(m.payload)))
        return out

    def wait_updates(
        self, round_: int, clients: set[str], timeout: float = 90.0
    ) -> list[PrototypeUpdate]:
        deadline = time.monotonic() + timeout
        while True:
            got = [u for c, u in self.updates() if u.round == round_]
            if {u.client for u in got} >= clients:
                return got
            self.inbox.wait(
                len(self.inbox.messages) + 1, timeout=max(0.1, deadline - time.monotonic())
            )


@pytest.mark.slow
def test_two_agents_three_rounds_with_a_kill_during_training(mosquitto, small_zoo, tmp_path):
    bundle_id = bundle_mod.load(small_zoo).id
    port = mosquitto.address.port
    cfg_a, labels_a = write_config(tmp_path / "a", small_zoo, "dev-a", "clean", port, epochs=1)
    cfg_b, labels_b = write_config(tmp_path / "b", small_zoo, "dev-b", "colour", port, epochs=1)
    expected = {"dev-a": labels_a, "dev-b": labels_b}
    with connected(
        mosquitto.address, "stand-in", subscribe=(update_filter("lab"), status_filter("lab"))
    ) as (pub, inbox):
        coord = StandInCoordinator(pub, inbox, bundle_id)
        # Killed once round 1's training ends, before anything of it is written or sent: a
        # kill timed after "training" could land after the update left (a loaded machine).
        a = agent_process(cfg_a, env={"PROTOFLEET_CRASH_AT": "after_training:1"})
        b = agent_process(cfg_b)
        try:
            coord.announce(0, [])
            r0 = coord.wait_updates(0, {"dev-a", "dev-b"})
            mark = a.wait_for("round 0: update published")
            coord.announce(1, r0)
            a.wait_for("round 1: training", after=mark)
            assert a.proc.wait(timeout=120) == -9  # killed by its crash point
            coord.wait_updates(1, {"dev-b"})
            a = agent_process(cfg_a)
            a.wait_for("round 1: training")  # nothing was committed: it trains round 1 again
            r1 = coord.wait_updates(1, {"dev-a", "dev-b"})
            coord.announce(2, r1)
            coord.wait_updates(2, {"dev-a", "dev-b"})
            # Settled once the coordinator's receipt names it, not when the broker took it.
            mark = a.wait_for("round 2: update stored by the coordinator")
            a.kill()  # idle, after answering round 2
            a = agent_process(cfg_a)
            a.wait_for("round 2: already_answered")
            assert a.stop() == 0 and b.stop() == 0
        finally:
            for proc in (a, b):
                if proc.proc.poll() is None:
                    proc.kill()
        updates = coord.updates()
        statuses = [
            Status.from_wire(m.payload)
            for m in inbox.messages
            if parse_topic(m.topic).kind.value == "status"
        ]
    per_round = Counter((client, u.round) for client, u in updates)
    assert per_round == {(c, r): 1 for c in ("dev-a", "dev-b") for r in range(3)}
    for client, u in updates:
        assert u.client == client and u.bundle == bundle_id
        labels = expected[u.client]
        assert u.counts == tuple(int((labels == c).sum()) for c in u.classes)
        assert sum(u.counts) == len(labels)
    assert any(s.state is AgentState.OFFLINE and s.reason == "shutdown" for s in statuses)
    # Restarts hit the feature cache: no backbone ran again.
    state = json.loads((tmp_path / "a" / "state" / "state.json").read_text())
    assert state["extra"]["backbone_samples_at_start"] == 0
    assert state["last_round"] == 2


@pytest.mark.slow
@pytest.mark.broker
def test_an_agent_started_before_its_broker_says_so_and_comes_online_with_it(small_zoo, tmp_path):
    port = free_port()
    config, _ = write_config(tmp_path / "a", small_zoo, "dev-a", "clean", port, epochs=1)
    agent = agent_process(config)
    try:
        agent.wait_for(
            f"cannot reach the broker at 127.0.0.1:{port} (Connection refused); reconnecting in"
        )
        with (
            MosquittoBroker(port=port) as broker,
            connected(broker.address, "watch", subscribe=(status_topic("lab", "dev-a"),)) as (
                _,
                inbox,
            ),
        ):
            # The first waits are 1-2 s (jittered backoff from reconnect_min_s = 1).
            message = inbox.wait(1, timeout=30)[0]
            assert Status.from_wire(message.payload).state is AgentState.ONLINE
            assert agent.stop() == 0
    finally:
        agent.close()


def test_waiting_for_an_acknowledgement_ends_with_it_or_with_a_stop():
    asked = Counter[str]()

    def stop_on_third_question() -> bool:
        asked["stopping"] += 1
        return asked["stopping"] >= 3

    acknowledged = mqtt.MQTTMessageInfo(1)
    acknowledged._set_as_published()  # what paho's network thread does on PUBACK
    assert wait_acknowledged(acknowledged, timeout=30, stopping=stop_on_third_question)
    assert asked["stopping"] == 0  # no waiting at all

    # A broker that never answers: the stop request ends the wait at once (the third
    # question), not after the 30 s timeout; the update is reported unacknowledged.
    unanswered = mqtt.MQTTMessageInfo(2)
    assert not wait_acknowledged(unanswered, timeout=30, stopping=stop_on_third_question)
    assert asked["stopping"] == 3
    assert not wait_acknowledged(unanswered, timeout=0.01, stopping=lambda: False)

    refused = mqtt.MQTTMessageInfo(3)
    refused.rc = mqtt.MQTT_ERR_QUEUE_SIZE
    with pytest.raises(ValueError, match="ERR_QUEUE_SIZE"):
        wait_acknowledged(refused, timeout=30, stopping=lambda: False)


@pytest.mark.slow
def test_a_device_that_cannot_take_part_says_why_in_its_status(mosquitto, small_zoo, tmp_path):
    bundle_id = bundle_mod.load(small_zoo).id
    config, _ = write_config(
        tmp_path / "a", small_zoo, "dev-a", "clean", mosquitto.address.port, epochs=1
    )
    with connected(
        mosquitto.address, "stand-in", subscribe=(update_filter("lab"), status_filter("lab"))
    ) as (pub, inbox):

        def reasons() -> list[str]:
            return [
                Status.from_wire(m.payload).reason
                for m in inbox.messages
                if parse_topic(m.topic).kind.value == "status"
            ]

        def wait_reason(predicate, what: str) -> None:
            deadline = time.monotonic() + 60
            while not any(predicate(r) for r in reasons()):
                try:
                    inbox.wait(len(inbox.messages) + 1, timeout=deadline - time.monotonic())
                except TimeoutError:
                    raise TimeoutError(f"no status {what}; got {reasons()}") from None

        coord = StandInCoordinator(pub, inbox, "0" * 64)  # a fleet on another bundle
        agent = agent_process(config)
        try:
            coord.announce(0, [])
            wait_reason(lambda r: r.startswith("ignoring rounds: the fleet uses bundle"), "why")
            (why,) = {r for r in reasons() if r.startswith("ignoring")}
            assert why == (
                "ignoring rounds: the fleet uses bundle 000000000000, "
                f"this device has {bundle_id[:12]}"
            )
            seen = len(reasons())
            coord.bundle_id = bundle_id  # the operator fixes the coordinator
            coord.announce(0, [])
            coord.wait_updates(0, {"dev-a"})
            wait_reason(lambda r: r == "", "taking it back")
            assert reasons()[seen:] == [""]  # said once, taken back once
            assert agent.stop() == 0
        finally:
            agent.close()


@pytest.mark.slow
def test_a_device_refused_for_good_is_told_why_and_stops_resending(mosquitto, small_zoo, tmp_path):
    # A device revoked while connected: the coordinator refuses its updates, and used to
    # leave it re-sending every resend_s, never told. Now a signed refusal says why.
    bundle_id = bundle_mod.load(small_zoo).id
    port = mosquitto.address.port
    config, _ = write_config(tmp_path / "a", small_zoo, "dev-a", "clean", port, epochs=1)
    config.write_text(
        config.read_text().replace(f"port = {port}\n", f"port = {port}\nresend_s = 1.0\n")
    )
    with connected(mosquitto.address, "stand-in", subscribe=(update_filter("lab"),)) as (
        pub,
        inbox,
    ):
        coord = StandInCoordinator(pub, inbox, bundle_id, refused="revoked")
        agent = agent_process(config)
        try:
            coord.announce(0, [])
            coord.wait_updates(0, {"dev-a"})
            agent.wait_for("the coordinator refuses this device's updates (revoked)")
            # The next round is answered (and refused) once more; by then, at resend_s = 1
            # and a round of training, a device still resending round 0 would have.
            coord.announce(1, [])
            coord.wait_updates(1, {"dev-a"})
            assert [u.round for _, u in coord.updates()].count(0) == 1
            assert agent.stop() == 0
        finally:
            agent.close()


@pytest.mark.slow
def test_a_second_agent_on_the_same_state_or_cache_is_refused_and_a_reload_keeps_serving(
    mosquitto, small_zoo, tmp_path
):
    # Two copies on one state folder would both write its privacy ledger and fight over
    # one MQTT client id.
    cache = tmp_path / "cache"
    configs = []
    for name in ("a", "b"):
        config, _ = write_config(
            tmp_path / name, small_zoo, f"dev-{name}", "clean", mosquitto.address.port, epochs=1
        )
        text = config.read_text().replace("[data]\n", f'[data]\nfeature_cache = "{cache}"\n')
        config.write_text(text)
        configs.append(config)
    first = agent_process(configs[0])
    try:
        first.wait_for("connected to")

        def refusal(config: Path) -> list[str]:
            started = subprocess.run(
                [str(BIN / "edge-agent"), "run", "--config", str(config)],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert started.returncode == 2
            return started.stderr.strip().splitlines()

        assert refusal(configs[0]) == [
            f"edge-agent: error: agent state {tmp_path / 'a' / 'state'} is in use by another "
            f"process (pid {first.proc.pid}); stop that one first"
        ]
        # Another device's state but the same private feature cache, which each would
        # prune of the other's entries.
        assert refusal(configs[1]) == [
            f"edge-agent: error: feature cache {cache} is in use by another process "
            f"(pid {first.proc.pid}); stop that one first, or set [data] shared_feature_cache "
            "= true in every agent that uses it"
        ]
        assert not (tmp_path / "b" / "state" / "state.json").exists()
        assert status("edge-agent", configs[0])["running_pid"] == first.proc.pid
        # A reload closes the running agent before the new one takes the same lock.
        seen = len(first.lines)
        first.signal(signal.SIGHUP)
        seen = first.wait_for("configuration reloaded", after=seen)
        first.wait_for("connected to", after=seen)
        assert not any("reload refused" in line for line in first.lines)
        assert first.stop() == 0
        assert status("edge-agent", configs[0])["running_pid"] is None
    finally:
        first.close()


@pytest.mark.slow
def test_two_devices_given_one_agent_id_are_told_so(mosquitto, small_zoo, tmp_path):
    # The broker drops the older of two sessions with one client id, and each reconnect
    # drops the other: without a word, this read as a flaky network. (An id no other test
    # uses: the session broker keeps their sessions.)
    port = mosquitto.address.port
    agents = [
        agent_process(write_config(tmp_path / n, small_zoo, "dev-twin", "clean", port, epochs=1)[0])
        for n in ("a", "b")
    ]
    try:
        # Both say it before either stops: the survivor's drops would end with the other.
        for agent in agents:
            agent.wait_for("is another client connected as 'dev-twin'?", timeout=120)
        assert [agent.stop() for agent in agents] == [0, 0]
    finally:
        for agent in agents:
            agent.close()
