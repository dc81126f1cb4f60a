import dataclasses
import hashlib
import logging
import sqlite3

import numpy as np
import pytest

from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import Commit, StateError, Store
from protocol import AgentState, Status
from protocol.weights import averaged_weight_shapes
from tests.coordinator_helpers import CLASSES, DIM, config, hand_globals, stand_in_update


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def manager(tmp_path, clock, **rounds):
    cfg = config(tmp_path, **rounds)
    return RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=clock)


def test_first_round_has_no_globals(tmp_path):
    m = manager(tmp_path, Clock())
    assert m.round == 0
    assert m.announcement.global_classes == ()
    assert m.announcement.params["final"] is False


def test_round_closes_after_quorum_and_grace_with_hand_computed_globals(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=2, wait_after_quorum_s=5.0, timeout_s=100.0)
    ups = [stand_in_update(i, 0) for i in range(2)]
    for u in ups:
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
    clock.now += 4.9
    assert m.poll() is None
    clock.now += 0.1
    nxt = m.poll()
    assert nxt is not None and nxt.round == 1 and m.round == 1
    expected = hand_globals(ups)
    assert nxt.global_classes == tuple(sorted(expected))
    for row, c in zip(nxt.global_prototypes, nxt.global_classes, strict=True):
        np.testing.assert_allclose(row, expected[c], rtol=1e-6)
    assert set(nxt.local_sets) == {"dev-0", "dev-1"}
    assert m.metrics.value("protofleet_rounds_completed_total") == 1


def test_everyone_on_the_allow_list_closes_at_once(tmp_path):
    clock = Clock()
    m = manager(
        tmp_path, clock, min_clients=1, wait_after_quorum_s=60.0, allow_list=("dev-0", "dev-1")
    )
    m.offer(stand_in_update(0, 0).to_wire())
    assert m.poll() is None
    m.offer(stand_in_update(1, 0).to_wire())
    assert m.poll() is not None


def test_deadline_without_quorum_extends(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=2, timeout_s=10.0)
    m.offer(stand_in_update(0, 0).to_wire())
    old = m.announcement.deadline
    clock.now += 10.0
    extended = m.poll()
    assert extended is not None and extended.round == 0
    assert extended.deadline == old + 10.0
    # at the deadline with the quorum the round closes
    m.offer(stand_in_update(1, 0).to_wire())
    clock.now += 10.0
    assert m.poll().round == 1


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(fleet="other"), "wrong_fleet"),
        (dict(bundle="0" * 64), "wrong_bundle"),
        (dict(method="fedproto"), "wrong_method"),
        (dict(round=5), "wrong_round"),
        (dict(classes=(0, 7)), "unknown_class"),
        (dict(prototypes=np.zeros((2, 3), np.float16)), "wrong_dim"),
    ],
)
def test_mismatched_updates_are_rejected_and_counted(tmp_path, change, reason):
    m = manager(tmp_path, Clock())
    bad = dataclasses.replace(stand_in_update(0, 0), **change)
    assert m.offer(bad.to_wire()).reason == reason
    assert m.store.summary()["rejections"] == {}  # counted in memory ...
    assert m.flush_rejections() == {reason: 1}  # ... and written every few seconds
    assert m.store.summary()["rejections"] == {reason: 1}
    assert m.metrics.value("protofleet_updates_rejected_total", reason=reason) == 1


def test_duplicates_malformed_and_foreign_clients(tmp_path):
    m = manager(tmp_path, Clock(), allow_list=("dev-0",))
    u = stand_in_update(0, 0)
    assert m.offer(u.to_wire(), topic_client="dev-0").accepted
    assert m.offer(u.to_wire(), topic_client="dev-0").reason == "duplicate"
    assert m.offer(u.to_wire(), topic_client="dev-9").reason == "client_mismatch"
    assert m.offer(stand_in_update(1, 0).to_wire()).reason == "not_allowed"
    assert m.offer(b"\xc1garbage").reason == "malformed"
    assert m.offer(b"x" * (5 << 20)).reason == "too_large"
    m.flush_rejections()
    assert m.store.summary()["rejections"] == {
        "duplicate": 1,
        "client_mismatch": 1,
        "not_allowed": 1,
        "malformed": 1,
        "too_large": 1,
    }


def test_restart_resumes_the_open_round_without_double_counting(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=3, wait_after_quorum_s=0.0)
    ups = [stand_in_update(i, 0) for i in range(3)]
    m.offer(ups[0].to_wire())
    m.offer(ups[1].to_wire())
    m.store.close()
    again = manager(tmp_path, clock, min_clients=3, wait_after_quorum_s=0.0)
    assert again.round == 0
    assert again.offer(ups[1].to_wire()).reason == "duplicate"  # QoS 1 redelivery after the crash
    assert again.offer(ups[2].to_wire()).accepted
    nxt = again.poll()
    expected = hand_globals(ups)
    for row, c in zip(nxt.global_prototypes, nxt.global_classes, strict=True):
        np.testing.assert_allclose(row, expected[c], rtol=1e-6)


def test_payloads_of_rounds_older_than_keep_rounds_are_dropped_their_times_kept(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=2, wait_after_quorum_s=0.0, keep_rounds=2)
    for r in range(5):
        for i in range(2):
            m.offer(stand_in_update(i, r).to_wire())
        clock.now += 1.0
        assert m.poll().round == r + 1
    # Round 5 is open; rounds 3 and 4 are the two closed rounds kept whole.
    m.offer(stand_in_update(0, 5).to_wire())
    db = sqlite3.connect(m.store.path)
    kept = db.execute("SELECT DISTINCT round FROM updates ORDER BY round").fetchall()
    sizes = dict(db.execute("SELECT round, length(announcement) FROM rounds"))
    closed = db.execute("SELECT COUNT(*) FROM rounds WHERE closed_at IS NOT NULL").fetchone()
    db.close()
    assert kept == [(3,), (4,), (5,)]
    assert [r for r, n in sorted(sizes.items()) if n == 0] == [0, 1, 2]
    assert all(sizes[r] > 0 for r in (3, 4, 5)) and closed == (5,)
    # A restart resumes the open round from what was kept.
    m.store.close()
    again = manager(tmp_path, clock, min_clients=2, wait_after_quorum_s=0.0, keep_rounds=2)
    assert again.round == 5 and again.announcement.to_wire() == m.announcement.to_wire()
    assert again.offer(stand_in_update(0, 5).to_wire()).reason == "duplicate"
    assert again.store.summary()["rounds_completed"] == 5
    # Each client's tally outlives the payloads; the duplicate above is not counted, and
    # devices that never sent a status message are listed all the same.
    tally = {
        c["client"]: (c["last_update_round"], c["updates_accepted"], c["state"])
        for c in again.store.summary()["clients"]
    }
    assert tally == {"dev-0": (5, 6, None), "dev-1": (4, 5, None)}


def test_a_database_from_before_the_tally_is_filled_from_its_updates(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=1, wait_after_quorum_s=0.0)
    for r in range(3):
        m.offer(stand_in_update(0, r).to_wire())
        m.poll()
    m.store.close()
    db = sqlite3.connect(m.store.path)
    db.execute("DROP TABLE contributions")  # as an older coordinator left it
    db.commit()
    db.close()
    again = manager(tmp_path, clock, min_clients=1, wait_after_quorum_s=0.0)
    (client,) = again.store.summary()["clients"]
    assert (client["client"], client["last_update_round"], client["updates_accepted"]) == (
        "dev-0",
        2,
        3,
    )


def test_keep_rounds_zero_keeps_every_payload(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=1, wait_after_quorum_s=0.0, keep_rounds=0)
    for r in range(3):
        m.offer(stand_in_update(0, r).to_wire())
        m.poll()
    assert [len(m.store.updates(r)) for r in range(3)] == [1, 1, 1]


def test_max_rounds_publishes_a_final_announcement(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=1, wait_after_quorum_s=0.0, max_rounds=2)
    for r in range(2):
        m.offer(stand_in_update(0, r).to_wire())
        nxt = m.poll()
    assert nxt.round == 2 and nxt.params["final"] is True and m.done
    assert m.offer(stand_in_update(0, 2).to_wire()).reason == "wrong_round"
    again = manager(tmp_path, clock, min_clients=1, wait_after_quorum_s=0.0, max_rounds=2)
    assert again.done and again.round == 2


def test_state_of_another_fleet_is_refused(tmp_path):
    manager(tmp_path, Clock()).store.close()
    cfg = config(tmp_path, method="fedproto")
    with pytest.raises(StateError, match="method"):
        RoundManager(config=cfg, store=Store(cfg.database))


def test_status_messages_update_the_client_table(tmp_path, caplog):
    m = manager(tmp_path, Clock(), allow_list=("dev-0",))
    online = Status(fleet="lab", client="dev-0", state=AgentState.ONLINE, version="0.1.0")
    m.record_status(online.to_wire(), topic_client="dev-0")
    assert m.metrics.value("protofleet_clients_online") == 1
    offline = Status(
        fleet="lab", client="dev-0", state=AgentState.OFFLINE, version="0.1.0", reason="lost"
    )
    with caplog.at_level(logging.INFO, logger="coordinator.rounds.presence"):
        # A restarted coordinator's session replays queued statuses: one line says it.
        for _ in range(3):
            m.record_status(offline.to_wire(), topic_client="dev-0")
    said = [r.getMessage() for r in caplog.records if r.name == "coordinator.rounds.presence"]
    assert said == ["client dev-0 is offline (lost)"]
    summary = m.store.summary()
    assert summary["clients"][0]["state"] == "offline" and summary["clients_online"] == 0
    assert summary["clients"][0]["updates_accepted"] is None  # it has sent none
    assert m.record_status(b"junk") is None


def test_the_aggregate_does_not_depend_on_the_order_updates_arrive_in(tmp_path):
    # FedAvg's weighted sums of many float values are where the order shows: summed in
    # arrival order, a few of 65,536 averages round differently (seeded: 7 here), and two
    # runs of the same fleet drifted apart from there.
    rng = np.random.default_rng(0)
    # A head of 4 x 16,384 first-layer weights: 65,536 averages again.
    shapes = averaged_weight_shapes(feature_dim=16_384, out_dim=DIM, num_classes=len(CLASSES))
    ups = [
        dataclasses.replace(
            stand_in_update(i, 0, method="fedavg"),
            extras={n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()},
        )
        for i in range(7)
    ]
    announcements = []
    for name, order in (("forward", ups), ("reversed", ups[::-1])):
        clock = Clock()
        cfg = config(
            tmp_path / name,
            method="fedavg",
            feature_dim=16_384,
            min_clients=7,
            wait_after_quorum_s=0.0,
        )
        m = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=clock)
        for u in order:
            clock.now += 1.0  # arrival times differ as well as the order
            assert m.offer(u.to_wire(), topic_client=u.client).accepted
        nxt = m.poll()
        assert nxt is not None and nxt.round == 1
        announcements.append(nxt)
    first, second = announcements
    assert set(first.extras) == set(shapes)
    for name in shapes:
        assert first.extras[name].tobytes() == second.extras[name].tobytes()


def test_a_round_without_its_quorum_closes_above_the_floor_after_its_extensions(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=3, timeout_s=10.0, max_extensions=2, floor=1)
    m.offer(stand_in_update(0, 0).to_wire())
    for extension in (1, 2):
        clock.now += 10.0
        extended = m.poll()
        assert extended is not None and extended.round == 0
        assert m.metrics.value("protofleet_round_extensions") == extension
    assert m.metrics.value("protofleet_round_stalled") == 0
    clock.now += 10.0
    closed = m.poll()
    assert closed is not None and closed.round == 1 and set(closed.local_sets) == {"dev-0"}


def test_a_round_below_its_floor_keeps_waiting_and_says_why(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=3, timeout_s=10.0, max_extensions=1, floor=2)
    m.offer(stand_in_update(0, 0).to_wire())
    for _ in range(3):
        clock.now += 10.0
        assert m.poll().round == 0
    assert m.metrics.value("protofleet_round_stalled") == 1
    summary = m.store.summary()["round"]
    assert summary["extensions"] == 3
    assert m.config.stalled(round_=0, updates=1, extensions=3) == (
        "round 0 has 1 update(s) after 3 deadline extensions, below rounds.floor = 2: "
        "it closes once that many devices answer"
    )
    # A restart keeps the count and the stall; a second update lets it close.
    m.store.close()
    again = manager(tmp_path, clock, min_clients=3, timeout_s=10.0, max_extensions=1, floor=2)
    assert again.metrics.value("protofleet_round_stalled") == 1
    again.offer(stand_in_update(1, 0).to_wire())
    clock.now += 10.0
    assert again.poll().round == 1
    assert again.metrics.value("protofleet_round_stalled") == 0


def test_statuses_of_unknown_clients_are_counted_not_stored_and_online_expires(tmp_path):
    clock = Clock()
    m = manager(tmp_path, clock, min_clients=3, online_ttl_s=60.0)

    def say(client: str) -> None:
        status = Status(fleet="lab", client=client, state=AgentState.ONLINE, version="x")
        m.record_status(status.to_wire(), topic_client=client)

    # Known: enrolled, allow-listed, or (as here, unsigned and open) once it has contributed.
    assert m.offer(stand_in_update(0, 0).to_wire(), topic_client="dev-0").accepted
    for i in range(2_000):  # a flood of invented ids, all "online"
        say(f"ghost-{i}")
    say("dev-0")
    say("dev-1")  # before its first update: not known yet
    assert m.flush_rejections() == {"status_unknown_client": 2_001}
    assert [c["client"] for c in m.store.summary()["clients"]] == ["dev-0"]
    assert m.metrics.value("protofleet_clients_online") == 1
    assert m.offer(stand_in_update(1, 0).to_wire(), topic_client="dev-1").accepted
    say("dev-1")
    assert [c["client"] for c in m.store.summary()["clients"]] == ["dev-0", "dev-1"]
    assert m.metrics.value("protofleet_clients_online") == 2
    clock.now += 61.0  # neither restated its status within online_ttl_s
    m.update_online()
    assert m.metrics.value("protofleet_clients_online") == 0
    assert m.store.summary(online_since=clock.now - 60.0)["clients_online"] == 0


def test_the_final_round_is_stored_closed_by_the_transaction_that_opens_it(tmp_path):
    # One transaction: a crash cannot leave it open for a restart to take updates into.
    store = Store(tmp_path / "c.db")
    store.open_first_round(b"a", opened_at=0.0, deadline=5.0)
    store.advance(Commit(0, closed_at=1.0, announcement=b"b", deadline=1.0, final=True))
    latest = store.latest_round()
    assert latest is not None and latest.round == 1 and latest.closed_at == 1.0
    store.advance(Commit(1, closed_at=2.0, announcement=b"c", deadline=9.0))
    opened = store.latest_round()
    assert opened is not None and opened.round == 2 and opened.closed_at is None
    store.close()


def test_an_accepted_update_names_its_digest_and_a_duplicate_the_first_copys(tmp_path):
    # What the device's receipt names: the SHA-256 of the update the store holds.
    m = manager(tmp_path, Clock(), min_clients=5)
    u0 = stand_in_update(0, 0)
    first = m.offer(u0.to_wire())
    assert first.accepted and first.digest == hashlib.sha256(u0.to_wire()).hexdigest()
    again = m.offer(u0.to_wire())
    assert again.reason == "duplicate" and again.digest == first.digest
    assert m.store.update_payload(0, "dev-0") == u0.to_wire()
