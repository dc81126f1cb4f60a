"""Hostile input against a real Mosquitto: what a client that can publish on the fleet's
topics (no TLS, no ACL, as the example configurations run) can and cannot do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.reliability_bench import publish_burst
from export import bundle as bundle_mod
from protocol import (
    AgentState,
    RoundAnnouncement,
    Status,
    round_topic,
    status_topic,
    update_filter,
    update_topic,
)
from protocol.weights import averaged_weight_shapes
from tests.agent_helpers import RUN, RUN_STARTED
from tests.coordinator_helpers import (
    coordinator_toml,
    finish,
    hand_fedavg,
    hand_globals,
    stand_in_update,
    stand_ins,
    start,
)
from tests.mqtt_helpers import connected
from tests.process_helpers import agent_process, status
from tests.test_agent_service import StandInCoordinator, write_config

pytestmark = pytest.mark.broker

FEATURE_DIM = 8


def test_counts_of_1e308_are_rejected_at_admission_and_the_coordinator_keeps_serving(
    mosquitto, tmp_path
):
    config = coordinator_toml(tmp_path, mosquitto.address.port, feature_dim=FEATURE_DIM)
    proc = start(config)
    try:
        with stand_ins(mosquitto, "hostile") as fleet:
            fleet.announcement(0)
            honest = [stand_in_update(i, 0) for i in range(3)]
            # Finite and non-negative, so the protocol lets it through; the sum of counts
            # times prototypes overflowed when the round closed.
            huge = dataclasses.replace(honest[0], counts=(1e308,) * len(honest[0].counts))
            fleet.send([huge, *honest])
            final = fleet.announcement(1)
        finish(proc)
    finally:
        proc.kill()
    expected = hand_globals(honest)
    assert final.global_classes == tuple(sorted(expected))
    for row, c in zip(final.global_prototypes, final.global_classes, strict=True):
        np.testing.assert_allclose(row, expected[c], rtol=1e-5, atol=1e-6)
    assert status("edge-coordinator", config)["rejections"] == {"count_above_max": 1}


def test_a_wrongly_shaped_fedavg_update_is_rejected_and_the_honest_average_announced(
    mosquitto, tmp_path
):
    config = coordinator_toml(
        tmp_path, mosquitto.address.port, feature_dim=FEATURE_DIM, method="fedavg", clients=2
    )
    shapes = averaged_weight_shapes(feature_dim=FEATURE_DIM, out_dim=4, num_classes=3)
    rng = np.random.default_rng(5)

    def weights() -> dict[str, np.ndarray]:
        return {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}

    # Client ids sort the wrong one first: it used to fix the shapes of the average.
    honest = [
        dataclasses.replace(stand_in_update(i, 0, method="fedavg"), client=f"dev-{i}", extras=w)
        for i, w in ((1, weights()), (2, weights()))
    ]
    wrong = dataclasses.replace(
        stand_in_update(0, 0, method="fedavg"), extras={"w": np.ones(1, np.float32)}
    )
    proc = start(config)
    try:
        with stand_ins(mosquitto, "hostile") as fleet:
            fleet.announcement(0)
            fleet.send([wrong, *honest])
            final = fleet.announcement(1)
        finish(proc)
    finally:
        proc.kill()
    assert set(final.extras) == set(shapes)
    want = hand_fedavg(honest)
    for name in shapes:
        np.testing.assert_allclose(final.extras[name], want[name], rtol=1e-5, atol=1e-6)
    assert status("edge-coordinator", config)["rejections"] == {"wrong_extras": 1}


@pytest.mark.slow
def test_a_forged_retained_announcement_is_ignored_and_the_device_answers_the_fleet(
    mosquitto, small_zoo, tmp_path
):
    bundle_id = bundle_mod.load(small_zoo).id
    cfg, _ = write_config(
        tmp_path / "a", small_zoo, "dev-a", "clean", mosquitto.address.port, epochs=1
    )
    with connected(mosquitto.address, "stand-in", subscribe=(update_filter("lab"),)) as (
        pub,
        inbox,
    ):
        coord = StandInCoordinator(pub, inbox, bundle_id)
        agent = agent_process(cfg)
        try:
            coord.announce(0, [])
            coord.wait_updates(0, {"dev-a"})
            seen = agent.wait_for("round 0: update published")
            forged = RoundAnnouncement(
                fleet="lab",
                round=2**31 - 1,
                run=RUN,
                run_started=RUN_STARTED,
                bundle=bundle_id,
                method="fedpcl",
                classes=tuple(str(i) for i in range(10)),
                dim=17,
                deadline=0.0,
                params={"final": False},
                global_classes=(0,),
                global_prototypes=np.ones((1, 17), np.float32),
            )
            pub.publish(round_topic("lab"), forged.to_wire(), qos=1, retain=True).wait_for_publish(
                10
            )
            seen = agent.wait_for("announcement ignored: round 2147483647", after=seen)
            assert agent.stop() == 0
            # The forged message is what the broker retains now: a restarted device gets it
            # first, ignores it, and answers the fleet's next round.
            agent = agent_process(cfg)
            agent.wait_for("announcement ignored: round 2147483647")
            coord.announce(1, [])
            coord.wait_updates(1, {"dev-a"})
            assert agent.stop() == 0
        finally:
            agent.close()
    shown = status("edge-agent", cfg)
    assert shown["last_round"] == 1
    assert shown["ignored_announcements"] == {"wrong_dim": 2}  # once per process


@pytest.mark.slow
def test_a_flood_of_ghost_statuses_leaves_the_clients_table_bounded(mosquitto, tmp_path):
    config = coordinator_toml(tmp_path, mosquitto.address.port, feature_dim=FEATURE_DIM, clients=4)
    proc = start(config)
    try:
        with stand_ins(mosquitto) as fleet:
            fleet.announcement(0)
            fleet.send([stand_in_update(i, 0) for i in range(3)])  # known from here on
            ghosts = [f"ghost-{i}" for i in range(20_000)]
            publish_burst(
                mosquitto.address,
                [status_topic("lab", g) for g in ghosts],
                [
                    Status(fleet="lab", client=g, state=AgentState.ONLINE, version="x").to_wire()
                    for g in ghosts
                ],
                client_id="ghosts",
            )
            real = Status(fleet="lab", client="dev-0", state=AgentState.ONLINE, version="0.1.0")
            fleet.publish(status_topic("lab", "dev-0"), real.to_wire())
            fleet.send([stand_in_update(3, 0)])  # the round closes behind the flood
            fleet.announcement(1, timeout=120)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    finally:
        proc.kill()
    shown = status("edge-coordinator", config)
    assert [c["client"] for c in shown["clients"]] == ["dev-0", "dev-1", "dev-2", "dev-3"]
    assert shown["clients_online"] == 1  # dev-0 said so; no ghost is stored
    # The broker may drop what overflows the coordinator's queue; the rest is counted.
    assert 0 < shown["rejections"]["status_unknown_client"] <= 20_000
    # Summarised per interval, not a line per message (WARNING and above are shown).
    assert len(stderr.splitlines()) < 20, stderr


@pytest.mark.slow
def test_20000_junk_messages_during_a_round_lose_no_honest_update(mosquitto, small_zoo, tmp_path):
    bundle_id = bundle_mod.load(small_zoo).id
    port = mosquitto.address.port
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'fleet = "lab"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[model]\nbundle = "{bundle_id}"\ndim = 32\n'
        "[rounds]\nmin_clients = 3\nwait_after_quorum_s = 0.0\ntimeout_s = 600.0\n"
        f"max_rounds = 1\n[mqtt]\nport = {port}\n[security]\ninsecure = true\n"
    )
    agents = []
    for name, domain in (("dev-a", "clean"), ("dev-b", "inverted"), ("dev-c", "colour")):
        cfg, _ = write_config(tmp_path / name, small_zoo, name, domain, port, epochs=3)
        cfg.write_text(cfg.read_text().replace("[mqtt]\n", "[mqtt]\nresend_s = 1.0\n"))
        agents.append(cfg)
    rng = np.random.default_rng(7)
    junk = [rng.bytes(int(n)) for n in rng.integers(1, 400, size=20_000)]
    topics = [update_topic("lab", f"junk-{i % 50}") for i in range(len(junk))]
    proc = start(config)
    procs = [agent_process(cfg) for cfg in agents]
    try:
        with stand_ins(mosquitto, "watch") as watch:
            procs[0].wait_for("round 0: training", timeout=180)
            publish_burst(mosquitto.address, topics, junk, client_id="junk")
            for agent in procs:
                agent.wait_for("round 0: update stored by the coordinator", timeout=180)
            final = watch.announcement(1, timeout=120)
        assert set(final.local_sets) == {"dev-a", "dev-b", "dev-c"}
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in stderr, stderr
        assert len(stderr.splitlines()) < 30, stderr  # summaries, not 20,000 lines
        for agent in procs:
            assert agent.stop() == 0
    finally:
        proc.kill()
        for agent in procs:
            agent.close()
    rejections = status("edge-coordinator", config)["rejections"]
    junk_counted = sum(n for r, n in rejections.items() if r != "duplicate" and "status" not in r)
    # Whatever the broker did not drop from the coordinator's full queue was counted.
    assert 0 < junk_counted <= 20_000
    # Duplicates are the devices' re-sends of updates already stored: answered, not lost.
    assert set(rejections) - {"duplicate", "status_unknown_client"} <= {
        "malformed", "field", "array", "id", "version", "too_large"
    }  # fmt: skip
