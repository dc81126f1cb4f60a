"""Privacy: the accountant against known values, hand composition, Opacus's accountant
and an independent PLD accountant; the release mechanisms by hand (clipping included);
secret mechanism randomness; metadata that neighbouring data sets cannot tell apart; the
durable ledger, the budget stop, and a SIGKILL between the ledger write and the update."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_agent.agent import Agent, Decision
from edge_agent.config import AgentConfig, PrivacySettings
from edge_agent.privacy import accounting as acc
from edge_agent.privacy.ledger import Ledger, LedgerError
from edge_agent.privacy.mechanisms import MechanismParams, release_dp, release_none, release_paper
from edge_agent.train_config import TrainConfig
from export import bundle as bundle_mod
from fleet.engine.evaluation import FleetEvaluator
from protocol import PrototypeUpdate, RoundAnnouncement
from tests.agent_helpers import agent_config

CLASSES = tuple(str(i) for i in range(10))


# -- accountant --------------------------------------------------------------------------------


def test_rdp_reproduces_the_known_value() -> None:
    history = [acc.Event(1.5, 0.04, 2250)]
    assert acc.epsilon(history, delta=1e-5) == pytest.approx(7.3291, abs=5e-5)


def test_prv_is_selectable_and_no_looser_than_rdp() -> None:
    history = [acc.Event(1.5, 0.04, 2250)]
    prv = acc.epsilon(history, delta=1e-5, accountant="prv")
    assert 5.0 < prv <= acc.epsilon(history, delta=1e-5)


def test_a_mixed_history_composes_to_the_sum_of_its_parts_at_every_order() -> None:
    orders = acc.orders()
    sgd_a = acc.Event(1.1, 0.05, 40)
    release = acc.release_event(3.0, 4.0)
    sgd_b = acc.Event(0.9, 0.1, 25)
    whole = acc.rdp([sgd_a, release, sgd_b, release], orders)
    parts = acc.rdp([sgd_a], orders) + 2 * acc.rdp([release], orders) + acc.rdp([sgd_b], orders)
    np.testing.assert_allclose(whole, parts, rtol=1e-12)
    # A release of sums and counts is the Gaussian mechanism: alpha/2 (1/s^2 + 1/c^2).
    by_hand = np.array(orders) / 2 * (1 / 3.0**2 + 1 / 4.0**2)
    np.testing.assert_allclose(acc.rdp([release], orders), by_hand, rtol=1e-9)
    assert acc.effective_sigma(2.0, 2.0) == pytest.approx(math.sqrt(2))


def test_plan_spends_the_budget_with_the_release_share() -> None:
    plan = acc.plan(epsilon_target=8.0, delta=1e-5, rounds=20, epochs=1, dataset_size=300, batch=32)
    assert plan.sample_rate == pytest.approx(32 / 300)
    assert plan.sgd_steps == 20 * 10 and plan.releases == 20
    assert 7.9 <= plan.epsilon <= 8.0
    assert acc.epsilon(plan.history(), delta=1e-5) == pytest.approx(plan.epsilon, rel=1e-6)
    releases_only = acc.epsilon([acc.Event(plan.release_noise_multiplier, 1.0, 20)], delta=1e-5)
    assert releases_only == pytest.approx(0.2 * 8.0, rel=0.01)
    with pytest.raises(ValueError, match="release share"):
        acc.plan(epsilon_target=8, delta=1e-5, rounds=1, epochs=1, dataset_size=10, batch=5,
                 release_share=1.5)  # fmt: skip


def test_the_sgd_schedule_is_a_function_of_public_settings() -> None:
    schedule = acc.sgd_schedule(dataset_size=300, batch=32, epochs=2)
    assert schedule.sample_rate == pytest.approx(32 / 300)
    assert schedule.steps == 2 * 10 and schedule.expected_batch == 32
    # A bound below one batch: every example every step, the batch is the bound.
    small = acc.sgd_schedule(dataset_size=20, batch=32, epochs=1)
    assert (small.sample_rate, small.steps, small.expected_batch) == (1.0, 1, 20)


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["dp", "dp-features"])
def test_opacus_reproduces_the_published_epsilon_and_pld_agrees(mechanism: str) -> None:
    """The epsilon a plan publishes, recomputed by Opacus's own accountant object from the
    plan's events, and by an independent PLD accountant (dp-accounting) within 10%."""
    import dp_accounting as dpa
    from opacus.accountants import RDPAccountant

    if mechanism == "dp":
        plan = acc.plan(epsilon_target=8.0, delta=1e-5, rounds=20, epochs=1,
                        dataset_size=100, batch=32)  # fmt: skip
    else:
        plan = acc.plan_features(epsilon_target=8.0, delta=1e-5, releases=2)
    opacus = RDPAccountant()
    opacus.history = [(e.noise_multiplier, e.sample_rate, e.count) for e in plan.history()]
    assert opacus.get_epsilon(delta=1e-5) == pytest.approx(plan.epsilon, rel=1e-9)
    events: list[dpa.DpEvent] = [
        dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(plan.release_noise_multiplier), plan.releases)
    ]
    if plan.sgd_steps:
        sampled = dpa.PoissonSampledDpEvent(
            plan.sample_rate, dpa.GaussianDpEvent(plan.sgd_noise_multiplier)
        )
        events.append(dpa.SelfComposedDpEvent(sampled, plan.sgd_steps))
    pld = dpa.pld.PLDAccountant()
    pld.compose(dpa.ComposedDpEvent(events))
    independent = pld.get_epsilon(1e-5)
    # RDP's conversion is an upper bound; the PLD is (nearly) tight.
    assert independent <= plan.epsilon * 1.001
    assert independent == pytest.approx(plan.epsilon, rel=0.10)


def test_the_feature_plan_spends_the_budget_over_its_releases() -> None:
    one = acc.plan_features(epsilon_target=4.0, delta=1e-5)
    three = acc.plan_features(epsilon_target=4.0, delta=1e-5, releases=3)
    assert 3.99 <= one.epsilon <= 4.0 and 3.99 <= three.epsilon <= 4.0
    assert three.release_noise_multiplier > one.release_noise_multiplier
    assert acc.epsilon(three.history(), delta=1e-5) == pytest.approx(three.epsilon, rel=1e-6)
    assert all(e.kind == "release" for e in three.history()) and len(three.history()) == 3


# -- mechanisms by hand -----------------------------------------------------------------------


def unit(rows: list[list[float]]) -> np.ndarray:
    z = np.array(rows, dtype=np.float32)
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def test_release_none_and_paper_by_hand() -> None:
    z = unit([[1, 0], [0, 1], [1, 1]])
    y = np.array([0, 0, 2])
    exact = release_none(z, y, 3, MechanismParams(), np.random.default_rng(0))
    assert exact.classes.tolist() == [0, 2] and exact.counts.tolist() == [2, 1]
    np.testing.assert_allclose(exact.prototypes, [[0.5, 0.5], z[2]], atol=1e-6)

    params = MechanismParams(paper_noise="laplace", paper_scale=0.05, paper_p=0.2)
    noisy = release_paper(z, y, 3, params, np.random.default_rng(7))
    e = np.random.default_rng(7).laplace(0.0, 0.05, size=(2, 2))
    np.testing.assert_allclose(noisy.prototypes, 0.8 * exact.prototypes + e, atol=1e-6)


def test_release_dp_sends_every_class_and_divides_noisy_sums_by_noisy_counts() -> None:
    z = unit([[1, 0], [0, 1], [1, 1]])
    y = np.array([0, 0, 2])
    params = MechanismParams(sum_sigma=2.0, count_sigma=3.0)
    out = release_dp(z, y, 4, params, np.random.default_rng(5))
    rng = np.random.default_rng(5)
    sums = np.array([[1, 1], [0, 0], z[2], [0, 0]], dtype=np.float64)
    noisy_sums = sums + rng.normal(0, 2.0, size=(4, 2))
    noisy_counts = np.array([2.0, 0, 1, 0]) + rng.normal(0, 3.0, size=4)
    assert out.classes.tolist() == [0, 1, 2, 3]  # absent classes too
    np.testing.assert_allclose(
        out.prototypes, noisy_sums / np.maximum(1, noisy_counts)[:, None], rtol=1e-5
    )
    # Sent as drawn (clamped at 0), as floats: no rounding, no size that depends on them.
    np.testing.assert_allclose(out.counts, np.maximum(0.0, noisy_counts))
    assert out.counts.dtype == np.float64


def test_release_dp_clips_a_zero_vector_and_one_of_norm_3_instead_of_refusing() -> None:
    from edge_agent.privacy.mechanisms import clip_rows

    z = np.array([[0.0, 0.0], [3.0, 0.0], [0.6, 0.8], [0.3, 0.4]])
    np.testing.assert_allclose(clip_rows(z), np.array([[0, 0], [1, 0], [0.6, 0.8], [0.3, 0.4]]))
    y = np.array([0, 0, 1, 1])
    out = release_dp(z, y, 2, MechanismParams(sum_sigma=0.5, count_sigma=0.5),
                     np.random.default_rng(9))  # fmt: skip
    rng = np.random.default_rng(9)
    # By hand: class 0 sums 0 + (1, 0); class 1 sums (0.6, 0.8) + (0.3, 0.4).
    sums = np.array([[1.0, 0.0], [0.9, 1.2]]) + rng.normal(0, 0.5, size=(2, 2))
    counts = np.array([2.0, 2.0]) + rng.normal(0, 0.5, size=2)
    np.testing.assert_allclose(out.prototypes, sums / np.maximum(1, counts)[:, None], rtol=1e-5)


def test_the_clipped_sum_has_sensitivity_1_under_add_or_remove() -> None:
    """By hand: removing the norm-3 vector moves its class's sum by exactly 1; and over
    random data sets and removed vectors of any norm, never by more."""
    from edge_agent.privacy.mechanisms import _sums, clip_rows

    z = np.array([[0.0, 0.0], [3.0, 0.0], [0.6, 0.8]])
    y = np.array([0, 0, 1])
    whole, _ = _sums(clip_rows(z), y, 2)
    without, _ = _sums(clip_rows(np.delete(z, 1, axis=0)), np.delete(y, 1), 2)
    assert np.linalg.norm(whole - without) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 20))
        x = rng.normal(size=(n, 5)) * rng.uniform(0, 10, size=(n, 1))
        labels = rng.integers(0, 3, size=n)
        drop = int(rng.integers(0, n))
        a, ca = _sums(clip_rows(x), labels, 3)
        b, cb = _sums(clip_rows(np.delete(x, drop, axis=0)), np.delete(labels, drop), 3)
        assert np.linalg.norm(a - b) <= 1.0 + 1e-9
        assert np.abs(ca - cb).sum() == 1.0


def test_mechanism_randomness_is_secret_unless_reproducible_is_asked_for() -> None:
    from edge_agent.privacy.randomness import DP_GUARANTEE, REPRODUCIBLE, NoiseSource, guarantee

    a, b = NoiseSource.create(), NoiseSource.create()
    assert not a.reproducible
    assert not np.array_equal(a.numpy.normal(size=8), b.numpy.normal(size=8))
    assert not torch.equal(torch.rand(64, generator=a.torch), torch.rand(64, generator=b.torch))
    c, d = NoiseSource.create(5), NoiseSource.create(5)
    assert c.reproducible
    np.testing.assert_array_equal(c.numpy.normal(size=8), d.numpy.normal(size=8))
    assert torch.equal(torch.rand(64, generator=c.torch), torch.rand(64, generator=d.torch))
    assert guarantee(formal=True, reproducible=False) == DP_GUARANTEE
    assert guarantee(formal=True, reproducible=True) == REPRODUCIBLE == "none (reproducible noise)"
    assert guarantee(formal=False, reproducible=False) == "none"


# -- ledger -----------------------------------------------------------------------------------


def test_one_reproducible_spend_voids_the_ledgers_guarantee_for_good(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, epsilon_budget=50.0, delta=1e-5, accountant="rdp")
    ledger.record(0, [acc.release_event(5.0, 5.0)])
    assert ledger.guarantee.startswith("(epsilon, delta)-DP")
    ledger.record(1, [acc.release_event(5.0, 5.0)], reproducible=True)
    ledger.record(2, [acc.release_event(5.0, 5.0)])
    document = json.loads((tmp_path / "privacy.json").read_text())
    assert document["guarantee"] == "none (reproducible noise)"
    assert [s["guarantee"] for s in document["spends"]][1] == "none (reproducible noise)"
    again = Ledger(tmp_path, epsilon_budget=50.0, delta=1e-5, accountant="rdp")
    assert again.guarantee == "none (reproducible noise)"


def test_ledger_is_durable_and_refuses_a_changed_delta(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, epsilon_budget=5.0, delta=1e-5, accountant="rdp")
    first = ledger.record(0, [acc.Event(1.0, 0.1, 10), acc.release_event(5.0, 5.0)])
    second = ledger.record(1, [acc.Event(1.0, 0.1, 10), acc.release_event(5.0, 5.0)])
    assert 0 < first < second
    again = Ledger(tmp_path, epsilon_budget=5.0, delta=1e-5, accountant="rdp")
    assert again.spent() == pytest.approx(second)
    assert json.loads((tmp_path / "privacy.json").read_text())["epsilon_spent"] == pytest.approx(
        second
    )
    with pytest.raises(LedgerError, match="delta"):
        Ledger(tmp_path, epsilon_budget=5.0, delta=1e-6, accountant="rdp")


# -- the agent ---------------------------------------------------------------------------------


def dp_config(
    root: Path,
    bundle: Path,
    *,
    epsilon: float,
    mechanism: str = "dp",
    seed: int | None = 3,
    train: Path | None = None,
) -> AgentConfig:
    """120 training samples (agent_helpers), a public bound of 120."""
    base = agent_config(root, bundle, agent_id="dev-dp", domain="clean")
    return replace(
        base,
        data=replace(base.data, train=train or base.data.train),
        train=TrainConfig(out_dim=32, norm="group" if mechanism == "dp" else "batch"),
        privacy=PrivacySettings(
            mechanism=mechanism,
            epsilon=epsilon,
            dataset_size=120,
            sgd_noise_multiplier=1.0,
            release_noise_multiplier=2.0,
            reproducible_noise_seed=seed,
        ),
    )


def announcement(
    bundle_id: str, round_: int, method: str = "fedpcl", dim: int = 32
) -> RoundAnnouncement:
    """Round 0 bare; later rounds carry global prototypes of ``dim`` (the head's; the
    features' under dp-features; 0 for none), so DP-SGD trains FedPCL's own objective
    (round 0 falls back to cross-entropy)."""
    globals_: dict[str, object] = {}
    if round_ > 0 and dim:
        protos = np.random.default_rng(round_).normal(size=(10, dim)).astype(np.float32)
        protos /= np.linalg.norm(protos, axis=1, keepdims=True)
        globals_ = {"global_classes": tuple(range(10)), "global_prototypes": protos}
    return RoundAnnouncement(
        fleet="lab", round=round_, bundle=bundle_id, method=method, classes=CLASSES,
        deadline=time.time() + 600, params={"final": False}, **globals_,  # type: ignore[arg-type]
    )  # fmt: skip


def test_dp_agent_reports_its_spend_and_stops_publishing_at_the_budget(
    small_zoo: Path, tmp_path: Path
) -> None:
    probe = Agent(dp_config(tmp_path / "probe", small_zoo, epsilon=1e6))
    two_rounds = probe.ledger.spent(probe.spending.dp_events() * 2)
    three_rounds = probe.ledger.spent(probe.spending.dp_events() * 3)
    # A budget that holds two rounds and not three.
    cfg = dp_config(tmp_path / "agent", small_zoo, epsilon=(two_rounds + three_rounds) / 2)
    agent = Agent(cfg)
    bundle_id = bundle_mod.load(small_zoo).id
    spent: list[float] = []
    for r in range(2):
        decision = agent.handle(announcement(bundle_id, r))
        assert decision.reason == "answered" and decision.payload is not None
        update = PrototypeUpdate.from_wire(decision.payload)
        assert update.privacy.mechanism == "dp" and update.privacy.delta == 1e-5
        assert update.classes == tuple(range(10))  # every class, held or not
        assert update.privacy.epsilon is not None
        spent.append(update.privacy.epsilon)
    assert 0 < spent[0] < spent[1] <= cfg.privacy.epsilon
    assert spent[1] == pytest.approx(agent.epsilon_spent)
    third = agent.handle(announcement(bundle_id, 2))
    assert third.reason == "budget_exhausted" and third.payload is None
    assert agent.state.snapshot.extra["privacy_exhausted"] is True
    assert agent.epsilon_spent == pytest.approx(spent[1])  # nothing spent on a refusal
    # It keeps serving predictions: its local prototypes are still on disk.
    assert agent.state.load_prototypes() is not None


def neighbour(train: Path, folder: Path) -> Path:
    """The same data set with one example (the 8th) removed: add/remove neighbours."""
    with np.load(train) as data:
        x, y = data["x"], data["y"]
    path = folder / "neighbour.npz"
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=np.delete(x, 7, axis=0), y=np.delete(y, 7))
    return path


def public_view(decision: Decision, fleet: str) -> dict[str, Any]:
    """Everything of an update an observer sees except the noised numbers themselves."""
    from protocol import topics

    reason, payload = decision.reason, decision.payload
    if payload is None:
        return {"reason": reason}
    update = PrototypeUpdate.from_wire(payload)
    return {
        "reason": reason,
        "topic": topics.update_topic(fleet, update.client),
        "size": len(payload),
        "round": update.round,
        "classes": update.classes,
        "counts_len": len(update.counts),
        "counts_types": {type(c).__name__ for c in update.counts},
        "shape": update.prototypes.shape,
        "dtype": str(update.prototypes.dtype),
        "extras": sorted(update.extras),
        "privacy": update.privacy.to_obj(),
    }


@pytest.mark.parametrize("mechanism", ["dp", "dp-features"])
def test_neighbouring_data_sets_publish_byte_identical_metadata(
    small_zoo: Path, tmp_path: Path, mechanism: str
) -> None:
    """One example removed: every update's epsilon, steps, round count, stop round, topic
    and size are the same; only the noised numbers differ. The budget holds two dp rounds
    (not three), and one dp-features release (sent again every round)."""
    probe = Agent(dp_config(tmp_path / "probe", small_zoo, epsilon=1e6, mechanism=mechanism))
    if mechanism == "dp":
        events = probe.spending.dp_events()
        budget = (probe.ledger.spent(events * 2) + probe.ledger.spent(events * 3)) / 2
    else:
        budget = probe.ledger.spent([probe.spending.release_event()]) * 1.5
    views, ledgers = [], []
    for name in ("full", "neighbour"):
        root = tmp_path / name
        cfg = dp_config(root, small_zoo, epsilon=budget, mechanism=mechanism, seed=None)
        if name == "neighbour":
            cfg = replace(cfg, data=replace(cfg.data, train=neighbour(cfg.data.train, root)))
        agent = Agent(cfg)
        views.append([public_view(agent.handle(announcement(agent.bundle_id, r,
                                                            dim=agent.prototype_dim)), "lab")
                      for r in range(4)])  # fmt: skip
        ledgers.append(json.loads((cfg.state_dir / "privacy.json").read_text()))
    with np.load(neighbour(probe.cfg.data.train, tmp_path / "n")) as data:
        assert len(data["y"]) == len(probe.train_labels) - 1 == 119
    assert views[0] == views[1]
    reasons = [v["reason"] for v in views[0]]
    if mechanism == "dp":
        assert reasons == ["answered", "answered", "budget_exhausted", "budget_exhausted"]
    else:
        assert reasons == ["answered"] * 4
        assert len({v["privacy"]["epsilon"] for v in views[0]}) == 1  # paid once
    assert views[0][0]["counts_types"] == {"float"}
    assert views[0][0]["privacy"]["guarantee"] == "(epsilon, delta)-DP, add/remove one example"
    for ledger in ledgers:
        ledger.pop("spends")  # identical events; their rounds and counts checked below
    assert ledgers[0] == ledgers[1]


def test_a_data_set_above_the_declared_bound_is_refused_before_anything_is_released(
    small_zoo: Path, tmp_path: Path
) -> None:
    from edge_agent.data import DataError

    cfg = dp_config(tmp_path, small_zoo, epsilon=8.0)
    cfg = replace(cfg, privacy=replace(cfg.privacy, dataset_size=100))
    with pytest.raises(DataError, match=r"120 training samples, above privacy.dataset_size = 100"):
        Agent(cfg)
    assert not (cfg.state_dir / "privacy.json").exists()


def test_the_same_seed_draws_different_noise_and_masks_unless_reproducible(
    small_zoo: Path, tmp_path: Path
) -> None:
    updates, heads = {}, {}
    for name, seed in (("a", None), ("b", None), ("c", 11), ("d", 11)):
        agent = Agent(dp_config(tmp_path / name, small_zoo, epsilon=100.0, seed=seed))
        decision = agent.handle(announcement(agent.bundle_id, 0))
        assert decision.payload is not None
        updates[name] = PrototypeUpdate.from_wire(decision.payload)
        heads[name] = torch.cat([p.detach().flatten() for p in agent.model.parameters()])
    assert not np.array_equal(updates["a"].prototypes, updates["b"].prototypes)
    assert not torch.equal(heads["a"], heads["b"])  # DP-SGD's masks and noise differ
    assert updates["a"].privacy.guarantee == "(epsilon, delta)-DP, add/remove one example"
    # Replayable noise: the same draws, and everything says the guarantee is void.
    np.testing.assert_array_equal(updates["c"].prototypes, updates["d"].prototypes)
    assert torch.equal(heads["c"], heads["d"])
    assert updates["c"].privacy.guarantee == "none (reproducible noise)"
    ledger = json.loads((tmp_path / "c" / "state" / "privacy.json").read_text())
    assert ledger["guarantee"] == "none (reproducible noise)"
    assert ledger["spends"][0]["guarantee"] == "none (reproducible noise)"
    from edge_agent.commands.status import _privacy_status

    status = _privacy_status(dp_config(tmp_path / "c", small_zoo, epsilon=100.0, seed=11), {})
    assert status["guarantee"] == "none (reproducible noise)"
    # A later secret configuration cannot restore what the ledger's past spends lost.
    status = _privacy_status(dp_config(tmp_path / "c", small_zoo, epsilon=100.0, seed=None), {})
    assert status["guarantee"] == "none (reproducible noise)"


def test_dp_sgd_draws_its_poisson_masks_from_the_noise_source(
    small_zoo: Path, tmp_path: Path
) -> None:
    """With a negligible gradient noise, two secret sources still train apart (their
    masks differ); two equal sources train to the same weights."""
    from edge_agent.privacy.dpsgd import train_round_dp
    from edge_agent.privacy.randomness import NoiseSource
    from edge_agent.train import Guidance, LocalModel, make_optimiser

    # 32 channels in 16 groups: a Poisson batch of one sample still has two values per
    # group to normalise (with 16 channels, one each, such a batch failed now and then).
    cfg = TrainConfig(out_dim=32, norm="group")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype(np.float32)
    y = rng.integers(0, 3, size=64)
    schedule = acc.sgd_schedule(dataset_size=64, batch=8, epochs=1)

    def weights(source: NoiseSource) -> torch.Tensor:
        torch.manual_seed(0)
        model = LocalModel(in_dim=12, num_classes=3, cfg=cfg)
        metrics = train_round_dp(model, make_optimiser(model, cfg), x, y, method="solo",
                                 guidance=Guidance.empty(3, 32), cfg=cfg, schedule=schedule,
                                 noise=source.torch, noise_multiplier=1e-6, max_grad_norm=1.0)  # fmt: skip
        assert metrics.steps == schedule.steps == 8
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert not torch.allclose(weights(NoiseSource.create()), weights(NoiseSource.create()))
    assert torch.equal(weights(NoiseSource.create(4)), weights(NoiseSource.create(4)))


def test_dp_features_releases_once_per_data_version(small_zoo: Path, tmp_path: Path) -> None:
    """The first round pays for the release; later rounds send the same bytes again at no
    cost, across a restart; new data is a new release and a new spend."""
    cfg = dp_config(tmp_path, small_zoo, epsilon=100.0, mechanism="dp-features", seed=None)
    agent = Agent(cfg)
    first = PrototypeUpdate.from_wire(agent.handle(announcement(agent.bundle_id, 0)).payload)
    assert first.prototypes.shape == (10, agent.runtime.feature_dim)  # the feature space
    spent = first.privacy.epsilon
    restarted = Agent(cfg)
    again = PrototypeUpdate.from_wire(
        restarted.handle(announcement(agent.bundle_id, 1, dim=agent.prototype_dim)).payload
    )
    np.testing.assert_array_equal(again.prototypes, first.prototypes)
    assert again.counts == first.counts and again.privacy.epsilon == spent
    assert len(restarted.ledger.spends) == 1
    changed = replace(cfg, data=replace(cfg.data, train=neighbour(cfg.data.train, tmp_path / "v2")))
    newer = Agent(changed)
    third = PrototypeUpdate.from_wire(
        newer.handle(announcement(agent.bundle_id, 2, dim=agent.prototype_dim)).payload
    )
    assert not np.array_equal(third.prototypes, first.prototypes)
    assert third.privacy.epsilon is not None and spent is not None and third.privacy.epsilon > spent
    assert len(newer.ledger.spends) == 2


def test_dp_features_trains_alone_when_no_anchor_helps(small_zoo: Path, tmp_path: Path) -> None:
    """Without global means (none announced in the feature space) every candidate trains
    the same objective on the same data order: the device keeps weight 0, its classifier,
    and the model that a Solo agent with the same seed trains."""
    cfg = dp_config(tmp_path / "features", small_zoo, epsilon=100.0, mechanism="dp-features")
    agent = Agent(cfg)
    solo_cfg = replace(agent_config(tmp_path / "solo", small_zoo, agent_id="dev-dp", domain="clean",
                                    method="solo"), train=cfg.train)  # fmt: skip
    solo = Agent(solo_cfg, evaluator=FleetEvaluator)
    for r in range(3):
        assert agent.handle(announcement(agent.bundle_id, r, dim=0)).reason == "answered"
        assert solo.handle(announcement(solo.bundle_id, r, "solo", dim=0)).reason == "answered"
    record, alone = agent.state.snapshot.history[-1], solo.state.snapshot.history[-1]
    assert record["anchor_weight"] == 0.0
    # The rule (classifier or own prototypes) is the device's choice on its validation split.
    figure = {"classifier": "test_accuracy_classifier",
              "local_prototype_cosine": "test_accuracy_prototype"}[record["predict_rule"]]  # fmt: skip
    assert record["test_accuracy"] == alone[figure]
    assert agent.predictor is agent.model
    for a, b in zip(agent.model.parameters(), solo.model.parameters(), strict=True):
        assert torch.equal(a, b)


SCRIPT = """
import sys, time
from pathlib import Path
from edge_agent.agent import Agent, Decision
from edge_agent.config import load
from tests.test_privacy import announcement
agent = Agent(load(Path(sys.argv[1])))
decision = agent.handle(announcement(agent.bundle_id, 0))
print(decision.reason, agent.epsilon_spent)
"""


@pytest.mark.slow
def test_sigkill_after_the_ledger_write_never_lowers_the_spent_epsilon(
    small_zoo: Path, tmp_path: Path
) -> None:
    root = tmp_path / "agent"
    cfg = dp_config(root, small_zoo, epsilon=100.0)
    config = root / "agent.toml"
    config.write_text(
        f'agent_id = "dev-dp"\nfleet = "lab"\nstate_dir = "{cfg.state_dir}"\n'
        f'bundle = "{small_zoo}"\n[data]\ntrain = "{cfg.data.train}"\n'
        f'[train]\nout_dim = 32\nnorm = "group"\n'
        f'[privacy]\nmechanism = "dp"\nepsilon = 100.0\nrelease_noise_multiplier = 2.0\n'
        f"dataset_size = 120\n"
        "[security]\ninsecure = true\n"
    )
    cwd = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PROTOFLEET_CRASH_AT": "after_ledger_write"}
    killed = subprocess.run([sys.executable, "-c", SCRIPT, str(config)], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    ledger = json.loads((cfg.state_dir / "privacy.json").read_text())
    before = ledger["epsilon_spent"]
    assert before > 0 and len(ledger["spends"]) == 1
    state = json.loads((cfg.state_dir / "state.json").read_text())
    assert state.get("last_round") is None  # the update was never stored

    env.pop("PROTOFLEET_CRASH_AT")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(config)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    reason, after = done.stdout.split()
    assert reason == "answered"
    # The lost release stays counted: the restart re-answers and pays again.
    assert float(after) > before
    assert len(json.loads((cfg.state_dir / "privacy.json").read_text())["spends"]) == 2


# -- audit ------------------------------------------------------------------------------------


def test_clopper_pearson_by_hand() -> None:
    from fleet.report.privacy_audit import clopper_pearson

    low, high = clopper_pearson(0, 100)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 100), rel=1e-9)
    low, high = clopper_pearson(100, 100)
    assert high == 1.0 and low == pytest.approx(0.025 ** (1 / 100), rel=1e-9)


@pytest.mark.parametrize("space", ["embeddings", "features"])
def test_the_canary_audit_holds_for_the_release_and_fails_for_a_broken_one(space: str) -> None:
    """Both formal releases: dp (unit embeddings) and dp-features (raw features of norms up
    to 3, clipped by the mechanism)."""
    from fleet.report.privacy_audit import canary_audit, release_broken

    real = canary_audit(runs=6000, seed=1, space=space)
    broken = canary_audit(runs=6000, seed=1, mechanism=release_broken, space=space)
    assert real.epsilon_claimed == broken.epsilon_claimed
    assert real.epsilon_lower_bound <= real.epsilon_claimed
    assert broken.epsilon_lower_bound > broken.epsilon_claimed  # the audit can fail


def test_label_inference_from_counts_with_and_without_noise() -> None:
    from fleet.report.privacy_audit import label_inference_error

    rng = np.random.default_rng(0)
    z = rng.normal(size=(60, 8))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    y = np.repeat([0, 1, 2], [40, 15, 5])
    true = np.bincount(y, minlength=4)
    exact = release_none(z, y, 4, MechanismParams(), rng)
    sent = np.zeros(4, np.int64)
    sent[exact.classes] = exact.counts
    assert label_inference_error(true, sent) == 0.0
    noisy = [
        label_inference_error(
            true, release_dp(z, y, 4, MechanismParams(sum_sigma=20.0, count_sigma=20.0), rng).counts
        )
        for _ in range(50)
    ]
    assert np.mean(noisy) > 0.15
