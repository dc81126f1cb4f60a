"""A secure fleet end to end (``privacy.aggregation = "secure"``): real agents and the
coordinator's service over a real Mosquitto, the statistics summed by secure aggregation.

The coordinator's head is the plain LDA of the devices' summed statistics within the
quantisation bound (noise off), no device's statistics are in its database or its log,
and the devices refuse to sum the same data twice.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import closed_form as cf
from coordinator.config import (
    CoordinatorConfig,
    ModelSettings,
    PrivacySettings,
    RoundSettings,
    WorkersSettings,
)
from coordinator.rounds import RoundManager
from coordinator.rounds.secure import SUM_KEY, FleetSum, SecureOutcome
from coordinator.service.service import CoordinatorService
from coordinator.storage.store import Store
from coordinator.strategies import RobustOptions
from coordinator.strategies.closed_form import LDA
from edge_agent.agent import Agent
from edge_agent.config import AgentConfig, ClosedFormSettings
from edge_agent.privacy.settings import PrivacySettings as AgentPrivacy
from edge_agent.secure_join import sum_view
from edge_agent.service import AgentService
from export.bundle import load as load_bundle
from fleet.transports.broker import MosquittoBroker
from fleet.transports.configs import FleetKeys, fleet_keys
from protocol import ProtocolError
from protocol.codec import unpack
from runtime.security import AgentSecurity, CoordinatorSecurity
from runtime.transport import MqttSettings
from secagg.fleet import (
    SINCE_EXTRA,
    SecureAggregation,
    flatten,
    flatten_prototypes,
    global_prototypes,
    unflatten,
)
from secagg.plan import decoded_noise_std
from secagg.quantise import sum_error_bound
from secagg.wire import CoordinatorWire
from tests.agent_helpers import CLASSES, agent_config, announcement

K = 12
DOMAINS = ("clean", "inverted", "colour")
TRAIN = 120  # agent_helpers' training samples per device


def _table(**overrides: object) -> SecureAggregation:
    base = dict(threshold=2, epsilon=0.0, dataset_size=TRAIN, stage_timeout_s=20.0)
    return SecureAggregation(**{**base, **overrides})  # type: ignore[arg-type]


def _keys(tmp_path: Path) -> FleetKeys:
    """The fleet's Ed25519 keys: signed, its coordinator expects the enrolled devices, so
    each stage closes as soon as they have answered instead of at its deadline; and the
    fleet CA's certificates, with which the devices check each other's keys."""
    return fleet_keys(tmp_path / "keys", [f"dev-{i}" for i in range(len(DOMAINS))])


def _signed(cfg: AgentConfig, tmp_path: Path) -> AgentConfig:
    keys = _keys(tmp_path)
    return dataclasses.replace(
        cfg,
        security=AgentSecurity(
            key=keys.agent_key(cfg.agent_id), coordinator=keys.coordinator_pub, ca=keys.ca_cert,
            certificate=keys.agent_certificate(cfg.agent_id),
        ),
    )  # fmt: skip


def _coordinator(
    tmp_path: Path, port: int, bundle: str, table: SecureAggregation
) -> CoordinatorConfig:
    keys = _keys(tmp_path)
    return CoordinatorConfig(
        fleet="lab",
        state_dir=tmp_path / "coordinator",
        model=ModelSettings(method="lda", bundle=bundle, classes=CLASSES, dim=K),
        rounds=RoundSettings(
            min_clients=len(DOMAINS), wait_after_quorum_s=0.0, timeout_s=600.0, max_rounds=2
        ),
        mqtt=MqttSettings(port=port),
        security=CoordinatorSecurity(key=keys.coordinator_key, devices=keys.devices),
        privacy=PrivacySettings(aggregation="secure"),
        secure_aggregation=table,
    )


def _agents(tmp_path: Path, bundle: Path, port: int, table: SecureAggregation) -> list[Agent]:
    agents = []
    for i, domain in enumerate(DOMAINS):
        cfg = agent_config(tmp_path / f"dev-{i}", bundle, agent_id=f"dev-{i}", domain=domain,
                           method="lda", port=port)  # fmt: skip
        cfg = dataclasses.replace(
            cfg, closed_form=ClosedFormSettings(dim=K),
            # The lifetime cap: one round's sum spends the table's epsilon (8 by default).
            privacy=AgentPrivacy(aggregation="secure", epsilon=max(8.0, table.epsilon)),
            secure_aggregation=table,
        )  # fmt: skip
        agents.append(Agent(_signed(cfg, tmp_path)))
    return agents


def _spy(
    outcomes: list[SecureOutcome], take: Callable[[SecureOutcome], bool]
) -> Callable[[SecureOutcome], bool]:
    """``take``, keeping each outcome it is handed (the sum the manager closes with)."""

    def taken(outcome: SecureOutcome) -> bool:
        outcomes.append(outcome)
        return take(outcome)

    return taken


@contextmanager
def _running(services: list[AgentService], coordinator: CoordinatorService) -> Iterator[None]:
    threads = [threading.Thread(target=s.run, daemon=True) for s in services]
    ready = threading.Event()
    main = threading.Thread(target=coordinator.run, kwargs={"ready": ready}, daemon=True)
    main.start()
    assert ready.wait(20)
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for s in services:
            s.stop()
        coordinator.stop()
        for t in [*threads, main]:
            t.join(30)


@pytest.mark.slow
def test_a_secure_lda_fleet_over_mosquitto_sums_the_statistics_and_keeps_none(
    small_zoo: Path,
    tmp_path: Path,
    mosquitto: MosquittoBroker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO)
    # A short stage deadline: round 1 waits it out for advertisements that never come
    # (round 0's stages close as soon as the three enrolled devices have answered).
    table = _table(stage_timeout_s=5.0)
    port = mosquitto.address.port
    bundle_id = load_bundle(small_zoo).id
    agents = _agents(tmp_path, small_zoo, port, table)
    config = _coordinator(tmp_path, port, bundle_id, table)
    manager = RoundManager(config=config, store=Store(config.database))
    services = [AgentService(agent=a) for a in agents]
    # What the secure round hands the manager: the unmasked sum (and nothing else).
    outcomes: list[SecureOutcome] = []
    monkeypatch.setattr(manager, "take_secure", _spy(outcomes, manager.take_secure))
    coordinator = CoordinatorService(manager=manager, exit_when_done=False)
    finished = threading.Event()
    with _running(services, coordinator):
        # Round 0 is the secure round; round 1 (final) carries its head.
        while not finished.wait(0.2):
            if manager.done or all(a.state.snapshot.extra.get("final_round") for a in agents):
                finished.set()
    assert manager.done
    announcement = manager.announcement
    assert announcement.global_classes, "the final announcement carries the solved head"

    # The unmasked sum is the plain sum of the devices' statistics within the
    # quantisation bound, and the announced head is the one solved from it.
    exact = [a.closed.statistics() for a in agents if a.closed is not None]
    total = np.sum([flatten(s, gram=True) for s in exact], axis=0)
    assert len(outcomes) == 2 and outcomes[1].total is None  # round 1: nobody has new data
    # An operator's view of the same two rounds (systemd/prometheus's dashboard).
    metrics = manager.metrics
    assert metrics.value("protofleet_secure_rounds_total", outcome="closed") == 1
    assert metrics.value("protofleet_secure_rounds_total", outcome="aborted") == 1
    assert metrics.value("protofleet_secure_round_seconds_count") == 2
    assert metrics.value("protofleet_secure_survivors") == len(DOMAINS)
    assert metrics.value("protofleet_secure_stage") == 0  # no round waits
    summed = outcomes[0]
    assert summed.survivors == len(DOMAINS) and summed.total is not None
    assert manager.secure is not None
    bound = sum_error_bound(len(exact), spec=manager.secure.settings.spec)
    assert 0 < np.abs(summed.total - total).max() < bound
    # Solved at the rounding's noise level: the sum carries it even without noise.
    rounding = decoded_noise_std(spec=manager.secure.settings.spec, plan=None, devices=len(exact))
    solved = LDA().solve_statistics(unflatten(summed.total, k=K, classes=len(CLASSES),
                                              gram=True, devices=len(exact)),
                                    noise_std=rounding)  # fmt: skip
    assert announcement.global_classes == solved.global_classes
    np.testing.assert_array_equal(
        announcement.global_prototypes,
        np.asarray(solved.global_prototypes).astype(announcement.global_prototypes.dtype),
    )

    # The fleet's running sum is kept (the sum, not a device's part) for a restart.
    kept = FleetSum.load(Store(config.database).meta_value(SUM_KEY), release=manager.secure)
    np.testing.assert_array_equal(flatten(kept.stats, gram=True), summed.total)
    assert kept.devices == len(DOMAINS)

    # Every device's statistics were summed once: the data is marked so, with the round and
    # the coordinator's signed close, and the sum records the same (issue 51).
    assert all(a.state.snapshot.extra.get("statistics_summed") for a in agents)
    assert kept.held == {a.cfg.agent_id: 0 for a in agents} and kept.since == 0
    assert announcement.extras[SINCE_EXTRA].tolist() == [0.0]
    wire = CoordinatorWire(fleet="lab", run=manager.run_id, signer=manager.keys.signer, devices={})
    for a in agents:
        summed_round, receipt = sum_view(a.state, run=manager.run_id, since=0)
        assert summed_round == 0 and wire.receipt_round(a.cfg.agent_id, receipt) == 0

    # Nothing of a device's statistics is in the coordinator's database or log.
    db = sqlite3.connect(config.database)
    blobs: list[bytes] = []
    for (table_name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        for row in db.execute(f'SELECT * FROM "{table_name}"'):
            for value in row:
                blobs.extend(_stored_bytes(value))
    assert db.execute("SELECT COUNT(*) FROM updates").fetchone()[0] == 0
    db.close()
    assert any(len(blob) > 1000 for blob in blobs)  # the running sum's arrays, read out
    for s in exact:
        for values in (s.sums, s.counts, cf.upper_triangle(s.gram)):  # type: ignore[arg-type]
            held = np.asarray(values).ravel()
            held = held[np.abs(held) > 1e-3][:8]  # distinctive values of this device's
            for dtype in (np.float64, np.float32, np.float16):
                needle = np.asarray(held, dtype=dtype).tobytes()[:8]
                assert not any(needle in blob for blob in blobs), dtype
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("coordinator"))
    for s in exact:
        for value in s.sums.ravel()[:20]:
            if abs(value) > 1e-3:
                assert f"{value:.6g}" not in text
    assert "head solved from the secure sum of 3 device(s)" in text
    # Each device's round record has the protocol's traffic.
    for a in agents:
        (record,) = [h for h in a.state.snapshot.history if h["round"] == 0]
        assert record["secagg_bytes_up"] > 1000 and record["secagg_bytes_down"] > 500


def _stored_bytes(value: object) -> list[bytes]:
    """Every byte string a stored value holds: a blob, and inside text (the meta table's
    JSON) every base64 string, with the byte strings of any msgpack map it encodes."""
    if isinstance(value, memoryview | bytes):
        raw = bytes(value)
        try:
            inner = unpack(raw, max_bytes=len(raw))
        except ProtocolError:
            return [raw]
        return [raw, *(b for v in inner.values() for b in _stored_bytes(v))]
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except ValueError:
            return []
        strings = data.values() if isinstance(data, dict) else []
        found = []
        for text in strings:
            if isinstance(text, str):
                with contextlib.suppress(ValueError):
                    found.extend(_stored_bytes(base64.b64decode(text, validate=True)))
        return found
    return []


@pytest.mark.slow
@pytest.mark.broker
def test_over_mosquitto_a_noisy_sums_head_is_solved_at_the_plans_noise_level(
    small_zoo: Path, tmp_path: Path, mosquitto: MosquittoBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protocol's coordinator solves the noisy sum as the simulated one does: with
    the plan's public noise level, so the scatter's directions the noise swamps are not
    amplified (closed_form/heads.py::lda_head)."""
    table = _table(stage_timeout_s=5.0, threshold=3, epsilon=1000.0)
    port = mosquitto.address.port
    agents = _agents(tmp_path, small_zoo, port, table)
    config = _coordinator(tmp_path, port, load_bundle(small_zoo).id, table)
    manager = RoundManager(config=config, store=Store(config.database))
    outcomes: list[SecureOutcome] = []
    # Before the service takes the method as its secure rounds' receiver.
    monkeypatch.setattr(manager, "take_secure", _spy(outcomes, manager.take_secure))
    coordinator = CoordinatorService(manager=manager, exit_when_done=False)
    finished = threading.Event()
    with _running([AgentService(agent=a) for a in agents], coordinator):
        while not finished.wait(0.2):
            if manager.done or all(a.state.snapshot.extra.get("final_round") for a in agents):
                finished.set()
    assert manager.done and manager.secure is not None and manager.secure.plan is not None
    summed = outcomes[0]
    assert summed.total is not None and summed.survivors == len(DOMAINS)
    stats = unflatten(summed.total, k=K, classes=len(CLASSES), gram=True, devices=len(DOMAINS))
    noise = decoded_noise_std(
        spec=manager.secure.settings.spec, plan=manager.secure.plan, devices=len(DOMAINS)
    )
    solved = LDA().solve_statistics(stats, noise_std=noise)
    announced = manager.announcement
    assert announced.global_classes == solved.global_classes
    np.testing.assert_array_equal(
        announced.global_prototypes,
        np.asarray(solved.global_prototypes).astype(announced.global_prototypes.dtype),
    )
    # ... and not as the exact sum would be: the floor is in the head.
    plain = LDA().solve_statistics(stats)
    assert not np.allclose(
        np.asarray(plain.global_prototypes), np.asarray(solved.global_prototypes)
    )


def _secure_agent(tmp_path: Path, bundle: Path, *, budget: float, **table: object) -> Agent:
    cfg = agent_config(tmp_path, bundle, agent_id="dev-0", domain="clean", method="lda")
    cfg = dataclasses.replace(
        cfg,
        closed_form=ClosedFormSettings(dim=K),
        privacy=AgentPrivacy(aggregation="secure", epsilon=budget),
        secure_aggregation=_table(**table),
    )
    return Agent(cfg)


def test_a_device_pays_for_the_sums_noise_as_its_input_leaves_and_joins_once_per_data(
    small_zoo: Path, tmp_path: Path
) -> None:
    agent = _secure_agent(tmp_path, small_zoo, budget=2.5, epsilon=1.0)
    bundle = agent.bundle_id
    first = agent.handle(announcement(bundle, 0, "lda", dim=K))
    assert first.reason == "secure" and first.secure is not None and first.payload is None
    # Joined, not paid (before issue 51 it was): a round that aborts before the masked
    # input leaves costs nothing. The link charges as it leaves.
    assert agent.epsilon_spent == 0.0 and first.secure.release is not None
    assert first.secure.release() and 0.5 < (spent := agent.epsilon_spent) <= 1.0
    # (The accountant prices the sum's Gaussian as the plan's RDP conversion does, at
    # most the round's epsilon, 1.)
    assert agent.mode.ledger.spends[-1].round == 0
    exact = flatten(agent.closed.statistics(), gram=True)  # type: ignore[union-attr]
    np.testing.assert_array_equal(first.secure.vector, exact)  # nothing summed before
    # Its round ended without it in the sum (it left after its input): it joins again.
    second = agent.handle(announcement(bundle, 1, "lda", dim=K))
    assert second.secure is not None and second.secure.release is not None
    assert second.secure.release() and agent.epsilon_spent > spent
    # Summed now: the same data does not join again, nor pay.
    agent.summed(second.secure)
    paid = agent.epsilon_spent
    assert agent.handle(announcement(bundle, 2, "lda", dim=K)).reason == "nothing_new"
    assert agent.epsilon_spent == paid
    # What the sum holds of it stays on the device: a new data version adds the
    # difference only.
    np.testing.assert_array_equal(agent.state.load_summed(exact.size), exact)
    assert not agent.state.load_summed(exact.size + 1).any()


def test_a_device_whose_budget_would_be_exceeded_does_not_join(
    small_zoo: Path, tmp_path: Path
) -> None:
    agent = _secure_agent(tmp_path, small_zoo, budget=1.0, epsilon=1.0)
    bundle = agent.bundle_id
    joined = agent.handle(announcement(bundle, 0, "lda", dim=K)).secure
    assert joined is not None and joined.release is not None and joined.release()
    spent = agent.epsilon_spent
    assert agent.handle(announcement(bundle, 1, "lda", dim=K)).reason == "budget_exhausted"
    assert agent.epsilon_spent == spent


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"method": "fedpcl"}, "fedpcl needs each device's own: use fedproto, lda, ridge"),
        ({"method": "fedcof"}, "fedcof needs each device's own"),
        (
            {"method": "fedproto", "secure_aggregation": _table(epsilon=1.0)},
            "fedproto's secure sum carries no noise",
        ),
        ({"privacy": AgentPrivacy(aggregation="secure", mechanism="dp-features")}, "set it to"),
        ({"secure_aggregation": SecureAggregation(dataset_size=20)}, "threshold must be set"),
        ({"secure_aggregation": SecureAggregation(threshold=3)}, "dataset_size must be set"),
        ({"security": AgentSecurity(key=Path("k"), coordinator=Path("c"))}, "needs security.ca"),
    ],
)
def test_a_device_configuration_that_cannot_sum_securely_is_refused_in_one_line(
    tmp_path: Path, change: dict[str, object], says: str
) -> None:
    cfg = agent_config(tmp_path, tmp_path / "bundle", agent_id="dev-0", domain="clean",
                       method="lda")  # fmt: skip
    base = {"privacy": AgentPrivacy(aggregation="secure"), "secure_aggregation": _table()}
    with pytest.raises(ValueError, match=re.escape(says)) as info:
        dataclasses.replace(cfg, **{**base, **change})  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"method": "fedpcl"}, "fedpcl needs each device's own"),
        ({"method": "fedproto"}, "[robust] medians need each device's rows"),
        ({"workers": WorkersSettings(count=2)}, "leave the [workers] table out"),
        ({"secure": SecureAggregation(dataset_size=20)}, "threshold must be set"),
    ],
)
def test_a_coordinator_configuration_that_cannot_sum_securely_is_refused_in_one_line(
    tmp_path: Path, change: dict[str, object], says: str
) -> None:
    config = _coordinator(tmp_path, 1883, "f" * 64, _table())
    model = dataclasses.replace(config.model, method=str(change.get("method", "lda")))
    with pytest.raises(ValueError, match=re.escape(says)) as info:
        dataclasses.replace(
            config,
            model=model,
            workers=change.get("workers", config.workers),  # type: ignore[arg-type]
            secure_aggregation=change.get("secure", config.secure_aggregation),  # type: ignore[arg-type]
        )
    assert "\n" not in str(info.value)


def test_a_secure_fedproto_fleet_announces_the_holders_mean_of_the_summed_rows(
    small_zoo: Path, tmp_path: Path, mosquitto: MosquittoBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = mosquitto.address.port
    table = _table(stage_timeout_s=20.0)
    agents = []
    for i, domain in enumerate(DOMAINS):
        cfg = agent_config(tmp_path / f"dev-{i}", small_zoo, agent_id=f"dev-{i}", domain=domain,
                           method="fedproto", port=port)  # fmt: skip
        cfg = dataclasses.replace(
            cfg, privacy=AgentPrivacy(aggregation="secure"), secure_aggregation=table
        )
        agents.append(Agent(_signed(cfg, tmp_path)))
    dim = agents[0].cfg.train.out_dim
    base = _coordinator(tmp_path, port, agents[0].bundle_id, table)
    config = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, method="fedproto", dim=dim),
        rounds=dataclasses.replace(base.rounds, max_rounds=1),
        robust=RobustOptions(
            median_count_cap=False, median_norm_clip=False, median_direction_screen=False
        ),
    )
    manager = RoundManager(config=config, store=Store(config.database))
    outcomes: list[SecureOutcome] = []
    monkeypatch.setattr(manager, "take_secure", _spy(outcomes, manager.take_secure))
    coordinator = CoordinatorService(manager=manager, exit_when_done=False)
    with _running([AgentService(agent=a) for a in agents], coordinator):
        done = threading.Event()
        while not done.wait(0.2):
            if manager.done:
                done.set()
    (outcome,) = outcomes
    assert outcome.survivors == len(DOMAINS) and outcome.total is not None
    rounds: list[tuple[np.ndarray, np.ndarray]] = []
    for a in agents:
        kept = a.state.load_prototypes()
        assert kept is not None
        rounds.append(kept)
    exact = np.sum([flatten_prototypes(p, n > 0) for p, n in rounds], axis=0)
    assert manager.secure is not None
    assert np.abs(outcome.total - exact).max() < sum_error_bound(
        3, spec=manager.secure.settings.spec
    )
    rows, has = global_prototypes(
        outcome.total, dim=dim, classes=len(CLASSES), threshold=table.threshold
    )
    announced = manager.announcement
    assert announced.global_classes == tuple(int(c) for c in np.flatnonzero(has))
    np.testing.assert_allclose(
        np.asarray(announced.global_prototypes, dtype=np.float64), rows[has], atol=2e-3
    )
    # The holders' mean: a class two devices hold is the mean of their two rows.
    holders = np.sum([(n > 0).astype(int) for _, n in rounds], axis=0)
    c = int(np.flatnonzero(holders == holders.max())[0])
    mean = np.mean([p[c] for p, n in rounds if n[c] > 0], axis=0)
    np.testing.assert_allclose(rows[c], mean, atol=1e-3)
    assert Store(config.database).update_clients(0) == []
