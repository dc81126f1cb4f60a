"""The bounded downlink (coordinator/downlink.py): which of FedPCL's local sets a round
announcement carries, its size against the budget, and the refusal of an announcement the
devices would drop."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator import downlink
from coordinator.config import AgentsSettings, CoordinatorConfig, ModelSettings
from coordinator.keys import CoordinatorKeys
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.announcements import Announcer, largest_announcement
from coordinator.storage.store import Store
from coordinator.strategies import Aggregate, make_strategy
from edge_agent.train import Guidance
from protocol import PrototypeUpdate, RoundAnnouncement
from runtime.keyfiles import generate_ed25519, load_signer
from runtime.security import CoordinatorSecurity
from tests.coordinator_helpers import config, stand_in_update

C, D = 10, 256  # the fleet: 10 classes, 256-d prototypes


# -- the pure functions, by hand ---------------------------------------------------------


def test_key_and_map_header_bytes_follow_msgpack() -> None:
    assert downlink.key_bytes("dev-1") == 6  # fixstr: one byte of header
    assert downlink.key_bytes("a" * 31) == 32
    assert downlink.key_bytes("a" * 32) == 34  # str8: two
    assert downlink.key_bytes("a" * 64) == 66
    assert [downlink.map_header_bytes(n) for n in (0, 15, 16, 65_535, 65_536)] == [1, 1, 3, 3, 5]


def test_sets_that_fit_by_hand() -> None:
    # rest 100 bytes (its empty map 1), sets of 50 bytes under keys "a" "b" "c" of 2 each:
    # all three take 100 - 1 + 1 + 3 * 52 = 256 bytes.
    clients = ["a", "b", "c"]
    assert downlink.encoded_bytes(rest=100, array_bytes=50, clients=clients) == 256
    assert downlink.sets_that_fit(budget=256, rest=100, array_bytes=50, clients=clients) == 3
    # One byte less: (255 - 100) // 52 = 2 sets, 204 bytes.
    assert downlink.sets_that_fit(budget=255, rest=100, array_bytes=50, clients=clients) == 2
    assert downlink.encoded_bytes(rest=100, array_bytes=50, clients=["a", "b"]) == 204
    assert downlink.sets_that_fit(budget=151, rest=100, array_bytes=50, clients=clients) == 0
    assert downlink.sets_that_fit(budget=50, rest=100, array_bytes=50, clients=clients) == 0
    # Counted at the longest id: keys of 2 and 41 bytes, budget for two of the short ones.
    mixed = ["a", "b" * 40]
    assert downlink.sets_that_fit(budget=203, rest=100, array_bytes=50, clients=mixed) == 1


def test_the_size_arithmetic_matches_the_encoder_across_map_headers() -> None:
    rows = np.zeros((3, 4), np.float16)
    base = RoundAnnouncement(fleet="lab", round=1, run="r1", run_started=0.0, bundle="b" * 64,
                             method="fedpcl", classes=("a", "b", "c"), dim=4, deadline=0.0,
                             global_classes=(0, 1, 2), global_prototypes=rows)  # fmt: skip
    rest = len(base.to_wire())
    one = len(dataclasses.replace(base, local_sets={"dev-0": rows}).to_wire())
    array_bytes = one - rest - downlink.key_bytes("dev-0")
    for n in (0, 1, 15, 16, 40):
        clients = [f"dev-{i}" for i in range(n)] + ["x" * 40] * (n > 3)
        sized = dataclasses.replace(base, local_sets={c: rows for c in clients})
        assert downlink.encoded_bytes(rest=rest, array_bytes=array_bytes, clients=clients) == len(
            sized.to_wire()
        )


def test_sample_clients_is_a_seeded_sorted_subset_whatever_the_arrival_order() -> None:
    clients = [f"c{i}" for i in range(10)]
    picked = downlink.sample_clients(clients, 4, seed=7)
    assert len(picked) == 4 and len(set(picked)) == 4 and set(picked) <= set(clients)
    assert list(picked) == sorted(picked)
    assert downlink.sample_clients(clients[::-1], 4, seed=7) == picked
    assert downlink.sample_clients(clients, 4, seed=8) != picked
    assert downlink.sample_clients(["b", "a"], 5, seed=0) == ("a", "b")
    with pytest.raises(ValueError, match="non-negative"):
        downlink.sample_clients(clients, -1, seed=0)


def test_the_sample_keeps_eq7s_average_in_expectation() -> None:
    # L_p averages a term l_p over the m clients; the device averages over the k it gets.
    # Uniform without replacement: every client is in with probability k/m, so the mean
    # of the sampled average is the full average (here (1 + ... + 6) / 6 = 3.5).
    clients = [f"c{i}" for i in range(6)]
    term = {c: float(i + 1) for i, c in enumerate(clients)}
    seeds = range(4000)
    samples = [
        downlink.sample_clients(clients, 3, seed=downlink.round_seed("lab", s)) for s in seeds
    ]
    averages = [np.mean([term[c] for c in s]) for s in samples]
    assert abs(np.mean(averages) - 3.5) < 0.03
    for c in clients:
        assert abs(sum(c in s for s in samples) / len(samples) - 0.5) < 0.03


def test_round_seed_comes_from_fleet_and_round_alone() -> None:
    assert downlink.round_seed("lab", 3) == downlink.round_seed("lab", 3)
    assert downlink.round_seed("lab", 3) != downlink.round_seed("lab", 4)
    assert downlink.round_seed("lab", 3) != downlink.round_seed("lab2", 3)


# -- the announcer at the sizes ------------------------------------------------


def fleet_updates(n: int, *, seed: int = 0) -> list[PrototypeUpdate]:
    """n FedPCL updates of 10 classes at 256-d, each client holding 3 to 10 of them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        picked = rng.choice(C, size=int(rng.integers(3, C + 1)), replace=False)
        classes = tuple(sorted(int(c) for c in picked))
        z = rng.normal(size=(len(classes), D))
        z /= np.linalg.norm(z, axis=1, keepdims=True)
        out.append(PrototypeUpdate(fleet="sim", round=0, client=f"client-{i:04d}",
                                   bundle="b" * 64, method="fedpcl", classes=classes,
                                   counts=tuple(int(c) for c in rng.integers(1, 50, len(classes))),
                                   prototypes=z.astype(np.float32)))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def signer_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keys")
    generate_ed25519(root / "c.key", root / "c.pub")
    return root / "c.key"


def announcer(tmp: Path, key: Path, **model: object) -> Announcer:
    settings = {"method": "fedpcl", "bundle": "b" * 64, "dim": D, **model}
    cfg = CoordinatorConfig(fleet="sim", state_dir=tmp, model=ModelSettings(**settings),  # type: ignore[arg-type]
                            security=CoordinatorSecurity(insecure=True))  # fmt: skip
    keys = CoordinatorKeys(signer=load_signer(key, setting="security.key"))
    return Announcer(config=cfg, keys=keys, run_id="r" * 32, run_started=0.0)


def aggregate(n: int) -> Aggregate:
    return make_strategy("fedpcl").aggregate(fleet_updates(n), num_classes=C, dim=D)


@pytest.mark.parametrize("dtype", ["f2", "f4"])
def test_five_clients_get_exactly_todays_announcement(tmp_path, signer_key, dtype) -> None:
    result = aggregate(5)
    bounded = announcer(tmp_path, signer_key, announce_dtype=dtype).announce(
        3, result, deadline=9.0
    )
    exact = announcer(tmp_path, signer_key, announce_dtype=dtype, downlink_budget=0).announce(
        3, result, deadline=9.0
    )
    assert len(bounded.local_sets) == 5
    assert bounded.to_wire() == exact.to_wire()  # bit for bit, signature included
    assert len(exact.to_wire()) <= downlink.DEFAULT_BUDGET


@pytest.mark.parametrize(("dtype", "sets"), [("f2", 11), ("f4", 5)])
def test_a_thousand_clients_get_a_sample_within_the_budget(tmp_path, signer_key, dtype, sets):
    result = aggregate(1000)
    ann = announcer(tmp_path, signer_key, announce_dtype=dtype)
    first = ann.announce(3, result, deadline=9.0)
    wire = first.to_wire()
    assert len(wire) <= downlink.DEFAULT_BUDGET
    assert len(first.local_sets) == sets
    # Each sent set is that client's exact padded set; the global prototypes are untouched.
    cast = np.float16 if dtype == "f2" else np.float32
    for client, rows in first.local_sets.items():
        np.testing.assert_array_equal(rows, result.local_sets[client].astype(cast))
    np.testing.assert_array_equal(first.global_prototypes, result.global_prototypes.astype(cast))
    # The same round gives the same sample (a restarted coordinator, another transport);
    # the next round another.
    assert ann.announce(3, result, deadline=9.0).to_wire() == wire
    assert set(ann.announce(4, result, deadline=9.0).local_sets) != set(first.local_sets)
    decoded = RoundAnnouncement.from_wire(wire, max_bytes=downlink.DEFAULT_BUDGET)
    assert set(decoded.local_sets) == set(first.local_sets)


def test_the_device_averages_over_the_sets_it_receives(tmp_path, signer_key) -> None:
    ann = announcer(tmp_path, signer_key, announce_dtype="f2").announce(
        3, aggregate(100), deadline=9.0
    )
    guide = Guidance.from_announcement(ann, client="client-0000", dim=D)
    assert guide.local_sets.shape == (11, C, D)
    targets = guide.fedpcl_targets(tau=0.07, include_positive=False)
    expected = torch.tensor([1.0] + [1 / 11] * 11)
    torch.testing.assert_close(targets.weights, expected.to(targets.weights.dtype))


def test_a_budget_with_room_for_fewer_than_the_floor_sends_the_floor_and_says_so_once(
    tmp_path, signer_key, caplog
) -> None:
    with pytest.raises(ValueError, match="downlink_budget must be >= 0"):
        ModelSettings(method="fedpcl", downlink_budget=-1)
    # Room for the global prototypes alone (5.5 kB in float16), not for one set beside them.
    ann = announcer(tmp_path, signer_key, announce_dtype="f2", downlink_budget=8_000)
    with caplog.at_level("WARNING", logger="coordinator.rounds.announcements"):
        first = ann.announce(3, aggregate(20), deadline=9.0)
        second = ann.announce(4, aggregate(20), deadline=9.0)
    assert len(first.local_sets) == len(second.local_sets) == downlink.MIN_SETS == 5
    assert set(first.local_sets) != set(second.local_sets)  # another sample each round
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1
    assert said[0].startswith("model.downlink_budget = 8000 bytes holds only 0 of the 20 local")
    assert "; sending 5 a round, above the budget" in said[0]


def test_a_small_fleet_whose_sets_all_fit_is_sent_them_without_a_warning(
    tmp_path, signer_key, caplog
) -> None:
    # Four clients, fewer than the floor: every set fits the default budget, so nothing
    # is said (the budget was once said to hold "4 local sets", the fleet's size).
    with caplog.at_level("WARNING", logger="coordinator.rounds.announcements"):
        sent = announcer(tmp_path, signer_key).announce(3, aggregate(4), deadline=9.0)
    assert len(sent.local_sets) == 4 and not caplog.records
    # A budget with room for none of them: all four go, and the warning counts right.
    tight = announcer(tmp_path / "tight", signer_key, announce_dtype="f2", downlink_budget=8_000)
    with caplog.at_level("WARNING", logger="coordinator.rounds.announcements"):
        assert len(tight.announce(3, aggregate(4), deadline=9.0).local_sets) == 4
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("model.downlink_budget = 8000 bytes holds only 0 of the 4 local sets")
    assert "; sending 4 a round, above the budget" in said


# -- refusing what the devices would drop ----------------------------------------------


def test_the_coordinator_refuses_an_announcement_above_the_agents_limit(tmp_path) -> None:
    # 40 exact local sets of 3 x 4 float32 (about 2.3 kB) against devices taking 1 kB.
    base = config(tmp_path, min_clients=40, wait_after_quorum_s=0.0)
    cfg = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, downlink_budget=0),
        agents=AgentsSettings(max_payload_bytes=1024),
    )
    manager = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics())
    opened = manager.announcement.to_wire()
    for i in range(40):
        update = stand_in_update(i, 0)
        assert manager.offer(update.to_wire(), topic_client=update.client).accepted
    with pytest.raises(downlink.AnnouncementRefused) as err:
        manager.poll()
    message = str(err.value)
    assert "\n" not in message  # the service's one error line
    assert message.startswith("round 1: refusing to publish an announcement of ")
    assert "above agents.max_payload_bytes = 1,024" in message
    assert "the fleet would stall" in message
    assert err.value.size > 1024 and err.value.setting == "agents.max_payload_bytes"
    # Nothing was published or stored: the round stays open with its updates.
    assert manager.round == 0 and manager.announcement.to_wire() == opened
    assert len(manager.store.updates(0)) == 40
    # Within a downlink budget the same round fits and closes.
    bounded = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, downlink_budget=900))
    manager.announcer = Announcer(
        config=bounded, keys=manager.keys, run_id=manager.run_id, run_started=manager.run_started
    )
    nxt = manager.poll()
    assert nxt is not None and nxt.round == 1
    assert 0 < len(nxt.local_sets) < 40 and len(nxt.to_wire()) <= 900


def test_the_largest_announcement_is_known_before_any_round_runs(tmp_path) -> None:
    # The refusal above, predicted from the clients, classes, dim and dtype alone: the size
    # is the one round 1 would have had, to the byte, and refused in the same words.
    base = config(tmp_path, min_clients=40, wait_after_quorum_s=0.0)
    cfg = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, downlink_budget=0),
        agents=AgentsSettings(max_payload_bytes=1024),
    )
    updates = [stand_in_update(i, 0) for i in range(40)]
    with pytest.raises(downlink.AnnouncementRefused) as predicted:
        largest_announcement(cfg, [u.client for u in updates], signer=None)
    manager = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics())
    for update in updates:
        manager.offer(update.to_wire(), topic_client=update.client)
    with pytest.raises(downlink.AnnouncementRefused) as measured:
        manager.poll()
    assert predicted.value.size == measured.value.size
    assert str(predicted.value) == str(measured.value)
    # Within a budget it fits, and so does the round.
    bounded = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, downlink_budget=900))
    largest = largest_announcement(bounded, [u.client for u in updates], signer=None)
    assert len(largest.to_wire()) <= 900 and 0 < len(largest.local_sets) < 40
