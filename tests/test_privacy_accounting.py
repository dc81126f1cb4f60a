"""The privacy accountant: known values, hand composition, the plans' spending, and
Opacus's own accountant and an independent PLD accountant (dp-accounting) against it."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from edge_agent.privacy import accounting as acc


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
