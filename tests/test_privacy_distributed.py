"""The distributed discrete Gaussian's plan and account (secagg/plan.py):
a calibration worked by hand, KLS's tau by hand, the rounding's sensitivity checked on real
statistics, monotonicity, the epsilon recomputed by Opacus's RDP accountant and charged by
the device's ledger, and the ring that a sum could wrap refused."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

import closed_form as cf
import edge_agent.privacy.accounting as acc
from secagg.fleet import ledger_multiplier
from secagg.plan import (
    RDP_ORDERS,
    DistributedPlan,
    SecureSum,
    check_ring,
    decoded_noise_std,
    example_support,
    kls_tau,
    plan_distributed,
    rdp_epsilon,
    statistics_clip,
    statistics_length,
    zcdp_epsilon,
    zcdp_for_epsilon,
)
from secagg.quantise import QuantiseSpec, max_devices, stochastic_round

#: ln(1/delta) = 4: the hand computations stay in square roots.
DELTA_E4 = math.exp(-4.0)
#: Delta = gamma * S + sqrt(support) = 1 + 1 = 2 in units.
TOY = SecureSum(sensitivity=1.0, support=1, length=1, scale=1.0, threshold=2)


def test_the_rdp_conversion_by_hand() -> None:
    # One finite divergence, 0.5 at order 12 (ln(1/delta) = 4):
    # 0.5 + ln(11/12) + (4 - ln 12) / 11 = 0.5 - 0.087011 + 0.137735.
    alone = [math.inf] * len(RDP_ORDERS)
    alone[RDP_ORDERS.index(12.0)] = 0.5
    assert rdp_epsilon(alone, DELTA_E4) == pytest.approx(0.550725, abs=1e-6)
    # rho = 1/18 is best read at order 7.1: 7.1/18 + ln(6.1/7.1) + (4 - ln 7.1)/6.1
    # = 0.394444 - 0.151806 + 0.334412 (7.0 gives 0.577087, 7.2 0.577232).
    assert zcdp_epsilon(1 / 18, DELTA_E4) == pytest.approx(0.577049, abs=1e-6)
    assert zcdp_epsilon(1 / 18, DELTA_E4, xi=0.5) == pytest.approx(0.5 + 0.577049, abs=1e-6)
    # Bun and Steinke's closed form, 1/18 + 2 sqrt(4/18) = 0.998, bounds it from above.
    assert zcdp_epsilon(1 / 18, DELTA_E4) < 1 / 18 + 2 * math.sqrt(2 / 9)
    rho = zcdp_for_epsilon(1.0, DELTA_E4)
    assert zcdp_epsilon(rho, DELTA_E4) == pytest.approx(1.0, abs=1e-9)
    assert zcdp_epsilon(rho * 1.001, DELTA_E4) > 1.0
    with pytest.raises(ValueError, match="orders"):
        rdp_epsilon([0.1, 0.2], DELTA_E4)
    # An order read as NaN bounds nothing; none at all, nothing is bounded.
    assert rdp_epsilon([math.nan if a != 12.0 else 0.5 for a in RDP_ORDERS],
                       DELTA_E4) == pytest.approx(0.550725, abs=1e-6)  # fmt: skip
    assert rdp_epsilon([math.nan] * len(RDP_ORDERS), DELTA_E4) == math.inf
    with pytest.raises(ValueError, match="delta"):
        zcdp_epsilon(0.1, 0.0)


def test_the_conversion_matches_opacus_at_the_same_orders() -> None:
    """Opacus's own reading of the same divergences (the device ledger's) agrees."""
    for rho in (0.005, 0.03, 1.2):
        rdp = [rho * a for a in RDP_ORDERS]
        theirs, _ = get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=1e-5)
        assert zcdp_epsilon(rho, 1e-5) == pytest.approx(float(theirs), rel=1e-12)
    # The orders are Opacus's defaults, the ones the ledger has always read.
    assert list(RDP_ORDERS) == list(map(float, RDPAccountant.DEFAULT_ALPHAS))


def test_a_small_epsilon_whose_best_order_lies_beyond_them_takes_the_closed_form() -> None:
    # rho 1e-5: the orders' best (63) reads 0.1035; the closed form 1e-5 + 2 sqrt(1e-5 *
    # 11.513) = 0.02147, the tighter of the two valid bounds.
    closed = 1e-5 + 2 * math.sqrt(1e-5 * math.log(1e5))
    assert zcdp_epsilon(1e-5, 1e-5) == pytest.approx(closed, rel=1e-12)
    assert rdp_epsilon([1e-5 * a for a in RDP_ORDERS], 1e-5) > 0.1
    # So a target no order reaches still gets a plan (the orders alone give no rho > 0).
    assert zcdp_for_epsilon(0.003, 1e-5) > 0
    plan = plan_distributed(release=TOY, epsilon_target=0.003, delta=1e-5)
    assert plan.epsilon <= 0.003 < TOY.epsilon(plan.sigma2 - 1, delta=1e-5)


def test_sigma_for_epsilon_one_worked_by_hand() -> None:
    # Delta = 2, m = t: rho = Delta^2 / (2 sigma^2) = 2 / sigma^2. At sigma^2 = 16, rho =
    # 1/8, read at order 5.3: 5.3/8 + ln(4.3/5.3) + (4 - ln 5.3)/4.3 = 0.6625 - 0.209091
    # + 0.542393 = 0.995802; at 15 (rho 2/15) no order gets below 1 (5.2: 1.039602).
    plan = plan_distributed(release=TOY, epsilon_target=1.0, delta=DELTA_E4)
    assert plan.sigma2 == 16
    assert plan.share_sigma2 == 8
    assert plan.epsilon == pytest.approx(0.995802, abs=1e-6)
    assert TOY.epsilon(15, delta=DELTA_E4) == pytest.approx(1.039602, abs=1e-6)


def test_colluding_devices_double_the_noise_when_half_the_shares_are_theirs() -> None:
    # t = 2, c = 1: the guarantee rests on one share of sigma^2 / 2, so sigma^2 must be
    # twice the 16 of two honest shares.
    half = SecureSum(sensitivity=1.0, support=1, length=1, scale=1.0, threshold=2, colluding=1)
    assert plan_distributed(release=half, epsilon_target=1.0, delta=DELTA_E4).sigma2 == 32


def test_kls_tau_by_hand() -> None:
    # Two shares of 1/pi^2: 10 exp(-2 pi^2 / pi^2 * 1/2) = 10 / e.
    assert kls_tau(1 / math.pi**2, 2) == pytest.approx(10 / math.e)
    # Three: 10 (exp(-1) + exp(-4/3)).
    assert kls_tau(1 / math.pi**2, 3) == pytest.approx(10 * (math.exp(-1) + math.exp(-4 / 3)))
    assert kls_tau(5.0, 1) == 0.0  # one discrete Gaussian needs no correction


def test_the_statistics_sizes_and_the_integer_sensitivity() -> None:
    # k = 2, C = 3: triangle 3, sums 6, counts 3; one example touches 3 + 2 + 1.
    assert statistics_length(2, classes=3) == 12
    assert example_support(2) == 6
    assert statistics_length(2, classes=3, gram=False) == 9
    assert example_support(2, gram=False) == 3
    release = SecureSum.of_statistics(k=2, classes=3, scale=4.0, threshold=5, colluding=1)
    assert release.units_sensitivity == pytest.approx(4 * math.sqrt(3) + math.sqrt(6))
    assert release.honest == 4
    assert statistics_clip(20) == 20.0


def test_rounded_neighbours_differ_by_at_most_the_integer_sensitivity() -> None:
    """The coupling argument on real statistics: with the same coins, the rounded release
    with and without one example differ by at most gamma * sqrt(3) + sqrt(support) in L2,
    for examples along an axis (where the float bound is reached) and random ones."""
    rng = np.random.default_rng(3)
    k, classes, scale = 4, 3, 2.0**3
    release = SecureSum.of_statistics(k=k, classes=classes, scale=scale, threshold=2)
    worst = 0.0
    for trial in range(300):
        rows = cf.clip_rows(rng.normal(size=(7, k)))
        labels = rng.integers(0, classes, size=7)
        x = np.eye(k)[trial % k] if trial % 2 else cf.clip_rows(rng.normal(size=(1, k)))[0]
        label = int(rng.integers(0, classes))
        base = _flat(cf.device_statistics(rows, labels, classes))
        delta = cf.release_delta(x, label, classes)
        u = rng.uniform(size=base.shape)
        moved = stochastic_round(scale * (base + delta), u) - stochastic_round(scale * base, u)
        worst = max(worst, float(np.linalg.norm(moved)))
    assert worst <= release.units_sensitivity
    assert worst > scale * math.sqrt(3)  # the rounding does add to it: the bound is not idle


def _flat(stats: cf.Statistics) -> np.ndarray:
    assert stats.gram is not None
    return np.concatenate([cf.upper_triangle(stats.gram), stats.sums.ravel(), stats.counts])


def test_more_noise_is_never_less_private_and_a_smaller_budget_needs_more() -> None:
    release = SecureSum.of_statistics(k=16, classes=10, scale=2.0**10, threshold=90, colluding=9)
    sigmas = [10.0**p for p in range(4, 12)]
    eps = [release.epsilon(s, delta=1e-5) for s in sigmas]
    assert all(a > b for a, b in itertools.pairwise(eps))
    targets = (16.0, 8.0, 4.0, 2.0, 1.0, 0.5)
    planned = [
        plan_distributed(release=release, epsilon_target=e, delta=1e-5).sigma2 for e in targets
    ]
    assert all(a < b for a, b in itertools.pairwise(planned))
    # More colluders, fewer honest shares: more noise for the same epsilon.
    by_c = [
        plan_distributed(
            release=SecureSum.of_statistics(
                k=16, classes=10, scale=2.0**10, threshold=90, colluding=c
            ),
            epsilon_target=1.0,
            delta=1e-5,
        ).sigma2
        for c in (0, 10, 45, 89)
    ]
    assert all(a < b for a, b in itertools.pairwise(by_c))


@pytest.mark.parametrize("target", [0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
@pytest.mark.parametrize("colluding", [0, 50])
def test_the_plan_never_spends_more_than_its_target(target: float, colluding: int) -> None:
    release = SecureSum.of_statistics(
        k=64, classes=10, scale=2.0**12, threshold=100, colluding=colluding
    )
    plan = plan_distributed(release=release, epsilon_target=target, delta=1e-5)
    assert plan.epsilon <= target
    # ... and is the smallest integer that does so.
    assert release.epsilon(plan.sigma2 - 1, delta=1e-5) > target


def test_a_share_of_a_few_units_pays_for_tau() -> None:
    """Tiny shares (gamma = 1 on a sensitivity of 0.1): tau is large and the plan must
    raise the noise beyond the tau-free closed form until the bound holds."""
    release = SecureSum(sensitivity=0.1, support=1, length=1000, scale=1.0, threshold=10)
    rho = zcdp_for_epsilon(8.0, 1e-5)
    closed_form = math.ceil(release.units_sensitivity**2 / (2 * rho))
    assert release.epsilon(closed_form, delta=1e-5) > 8.0
    plan = plan_distributed(release=release, epsilon_target=8.0, delta=1e-5)
    assert plan.sigma2 > closed_form
    assert plan.epsilon <= 8.0


@pytest.mark.parametrize("target", [0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
@pytest.mark.parametrize("k", [64, 512])
def test_opacus_and_the_ledger_price_the_plan_as_it_says(target: float, k: int) -> None:
    """An independent accountant: Opacus's RDP of the continuous Gaussian with the same
    integer sensitivity and honest noise (multiplier sqrt(m sigma^2 / t) / Delta, one step,
    sample rate 1) and its own RDP-to-DP conversion, at the same orders, finds the plan's
    epsilon (the bound's tau term is below a double here); the device's ledger, which
    prices the round from the same multiplier, charges no more than the plan says, so a
    device whose budget is the plan's target takes the round."""
    release = SecureSum.of_statistics(k=k, classes=10, scale=2.0**15, threshold=900, colluding=90)
    plan = plan_distributed(release=release, epsilon_target=target, delta=1e-5)
    z = release.equivalent_multiplier(plan.sigma2)
    orders = list(RDPAccountant.DEFAULT_ALPHAS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        rdp = compute_rdp(q=1.0, noise_multiplier=z, steps=1, orders=orders)
        theirs, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert float(theirs) == pytest.approx(plan.epsilon, rel=1e-9)
    # The zCDP of the Gaussian is the RDP Opacus computes at every order: alpha * rho.
    rho = release.zcdp(plan.sigma2)[0][1]
    assert np.allclose(rdp, np.asarray(orders) * rho, rtol=1e-9)
    charged = acc.epsilon([acc.gaussian_release(ledger_multiplier(plan))], delta=1e-5)
    assert charged <= plan.epsilon * (1 + 1e-12) and plan.epsilon <= target
    assert charged == pytest.approx(plan.epsilon, rel=1e-6)


def test_a_ring_the_sum_could_wrap_is_refused() -> None:
    release = SecureSum.of_statistics(k=64, classes=10, scale=2.0**15, threshold=900, colluding=90)
    plan = plan_distributed(release=release, epsilon_target=1.0, delta=1e-5)
    wide = QuantiseSpec(clip=statistics_clip(20), scale=2.0**15, bits=64)
    check_ring(plan, spec=wide, devices=1000)
    # 32 bits: 1,000 devices of 20 * 2^15 units each fill 2^29.3 of the 2^31 ...
    narrow = QuantiseSpec(clip=statistics_clip(20), scale=2.0**15, bits=32)
    check_ring(plan, spec=narrow, devices=1000)
    # ... and 4,000 fill 2^31.3: refused, saying what holds and what to change.
    with pytest.raises(ValueError, match=r"32-bit ring holds the sum of at most \d+ devices"):
        check_ring(plan, spec=narrow, devices=4000)


def test_the_noise_alone_can_be_what_does_not_fit() -> None:
    release = SecureSum(sensitivity=1.0, support=1, length=1, scale=1.0, threshold=1000)
    spec = QuantiseSpec(clip=1.0, scale=1.0, bits=32)
    # 1,000 devices of one unit each fit a 32-bit ring many times over without noise; a
    # summed parameter of 2^62 (standard deviation 2^31) leaves no room for ten of them.
    assert max_devices(spec=spec) >= 1000
    loud = DistributedPlan(release, 2**62, epsilon=0.0, delta=1e-5)
    with pytest.raises(ValueError, match="noise standard deviations"):
        check_ring(loud, spec=spec, devices=1000)


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="no honest share"):
        SecureSum(sensitivity=1.0, support=1, length=1, scale=1.0, threshold=3, colluding=3)
    with pytest.raises(ValueError, match="support"):
        SecureSum(sensitivity=1.0, support=5, length=4, scale=1.0, threshold=3)
    with pytest.raises(ValueError, match="delta"):
        plan_distributed(release=TOY, epsilon_target=1.0, delta=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        plan_distributed(release=TOY, epsilon_target=0.0, delta=1e-5)
    plan = plan_distributed(release=TOY, epsilon_target=1.0, delta=DELTA_E4)
    with pytest.raises(ValueError, match="scale"):
        check_ring(plan, spec=QuantiseSpec(clip=1.0, scale=2.0), devices=2)
    with pytest.raises(ValueError, match="survivors"):
        plan.sum_std(1)


def test_the_decoded_sums_noise_level_adds_the_roundings_to_the_plans() -> None:
    spec = QuantiseSpec(clip=10.0, scale=2.0, bits=32)
    # Four devices' roundings, each of variance <= 1/4 unit^2: sqrt(4) / (2 * 2) = 0.5.
    assert decoded_noise_std(spec=spec, plan=None, devices=4) == 0.5
    release = SecureSum(sensitivity=1.0, support=1, length=4, scale=2.0, threshold=4)
    plan = DistributedPlan(release, 12, 1.0, 1e-5)  # 12 / 4 = 3 units^2 a share
    # The plan's: sqrt(4 * 3) / 2 = sqrt(3); with the rounding's: sqrt(3 + 0.25).
    assert decoded_noise_std(spec=spec, plan=plan, devices=4) == pytest.approx(math.sqrt(3.25))
    with pytest.raises(ValueError, match="0 devices"):
        decoded_noise_std(spec=spec, plan=None, devices=0)
