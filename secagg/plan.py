"""The plan and account of a closed-form release through secure aggregation with the
distributed discrete Gaussian: what noise each device adds, and what the sum is worth.

Each device sends its statistics ``[triu(G), sums (C*k), counts (C)]`` (length ``d``)
clipped per coordinate, scaled by the public ``scale`` (``gamma``), stochastically rounded,
plus its share ``N_Z(0, sigma^2 / t)`` per coordinate (``secagg``). The coordinator
sees only the ring sum. Every input here is public; the functions are pure.

**Sensitivity in the integer domain.** One example of norm <= 1 changes the float vector
by ``delta`` with ``||delta||_2 <= S`` (``S = sqrt(3)`` with the second moment, ``sqrt(2)``
without: ``closed_form/privacy.py::sensitivity_bound``, docs/privacy.md) on at most
``support`` coordinates (the Gram triangle, one class's sum, one count). Stochastic
rounding is ``R_u(y) = ceil(y - u)`` with ``u`` uniform on [0, 1), the device's own coins,
drawn independently of its data. Coupling the two neighbouring data sets through the same
coins, each coordinate's integer change is ``gamma * delta_j + e_j`` with ``|e_j| < 1``,
and ``e_j = 0`` where ``delta_j = 0`` (the per-coordinate clip is monotone and 1-Lipschitz,
so it keeps both facts). So for every ``u`` the integer vectors differ by at most
``Delta = gamma * S + sqrt(support)`` in L2, and the output, a mixture over ``u`` of
mechanisms with that sensitivity, is no less private than the worst of them (Renyi
divergence is jointly quasi-convex: van Erven and Harremoes 2014, Thm. 13). This is the
"add sqrt(d)" inflation of Kairouz, Liu and Steinke's Theorem 1 bound (conditional rounding
with ``beta = 0``; the authors' ``rounded_l2_norm_bound``), with ``d`` narrowed to the
coordinates one example can touch. Why not their conditional rounding: re-drawing the
coins until the norm fits needs the norm of the whole rounded vector, here dominated by the
device's own data, and it biases the sum; the inflation costs under 1% of ``Delta`` once
``gamma * S >= 100 sqrt(support)`` (:attr:`SecureSum.inflation`).

**Who holds the noise.** A round finishes with ``s >= t`` survivors, whose shares add to
``s sigma^2 / t >= sigma^2``. Up to ``c`` devices may collude with the coordinator and
subtract their shares; the example's own device is honest (it is its data). The guarantee
rests on the ``m = t - c`` honest shares alone: any further share is independent of the
data, so adding it is post-processing. Modular wrap-around is post-processing of the
integer sum too: it can cost accuracy, never privacy (:func:`check_ring` refuses a ring
that a realistic sum could wrap).

**The sum of discrete Gaussians.** ``m`` draws of ``N_Z(0, sigma_1^2)`` do not add to a
discrete Gaussian. Kairouz, Liu and Steinke (ICML 2021) bound the mechanism with
``tau = 10 * sum_{k=1}^{m-1} exp(-2 pi^2 sigma_1^2 k / (k + 1))`` (their Theorem 1): with
``x = Delta / (sqrt(m) sigma_1)``, its Renyi divergence of order ``alpha`` is at most
``min(alpha x^2 / 2 + tau d, alpha (x + sqrt(d) tau)^2 / 2)`` (their Proposition 14, Eq.
17). The paper's text is not in /work/shared/papers: the formulas are read from the
authors' accounting code (google-research/federated, ``distributed_dp/accounting_utils.py``:
``ddgauss_epsilon``, ``compute_rdp_dgaussian_simplified``), not from memory, and the
conservative route is taken: the two-term form of that code (its three-term form can be
smaller, never larger), ``beta = 0``, and a plan that only counts ``m = t - c`` shares.
The ``tau`` term is ``exp(-2 pi^2 sigma_1^2 / 2)`` to leading order: for every plan a
fleet would run (``sigma_1`` in the thousands of units) it is below the smallest double,
and the bound is the continuous Gaussian's, ``rho = Delta^2 / (2 m sigma_1^2)``, which
Canonne, Kamath and Steinke (NeurIPS 2020) prove for one discrete Gaussian. The first form
is ``(xi, rho)``-zCDP with ``xi = tau d``, the second ``rho'``-zCDP.

**To (epsilon, delta).** The RDP conversion of Balle et al. (AISTATS 2020, Thm. 21), also
Canonne, Kamath and Steinke's Prop. 12: an ``(alpha, r)``-RDP mechanism is
``(r + ln(1 - 1/alpha) - (ln delta + ln alpha) / (alpha - 1), delta)``-DP, for every
``alpha``; with ``r = xi + rho alpha`` at each of :data:`RDP_ORDERS`, the least is taken
(or, for epsilons whose best order lies beyond them, the closed form below).
It is what Opacus applies to the device's ledger (edge_agent/privacy/accounting.py) at the
same orders, so a device prices one round at no more than the plan says it costs
(``tests/test_privacy_distributed.py`` checks both against Opacus). Why not the closed form
``xi + rho + 2 sqrt(rho ln(1/delta))`` (Bun and Steinke 2016, Prop. 1.3), which plans used
before: it is 23% higher at epsilon 1 and delta 1e-5, so its noise had a 21% larger
standard deviation than the guarantee needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import closed_form as cf
from secagg.quantise import QuantiseSpec, max_devices
from secagg.settings import NOISE_TAILS

#: The Renyi orders every epsilon is read at: Opacus's defaults, which the device's ledger
#: reads (edge_agent/privacy/accounting.py). Why not more: a ledger read at new orders
#: would price the spends it already holds anew, lower, and its spent epsilon never goes
#: down (edge_agent/privacy/ledger.py). Below about epsilon 0.3 (delta 1e-5) the best order
#: lies above 63 and :func:`zcdp_epsilon` takes the closed form instead.
RDP_ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)), *map(float, range(12, 64)),
)  # fmt: skip


def statistics_length(k: int, *, classes: int, gram: bool = True) -> int:
    """``d``: the released vector's length, ``[triu(G), sums (C*k), counts (C)]``."""
    if k < 1 or classes < 1:
        raise ValueError(f"need k >= 1 and classes >= 1, got {k}, {classes}")
    return (cf.triangle_size(k) if gram else 0) + classes * k + classes


def example_support(k: int, *, gram: bool = True) -> int:
    """How many of those coordinates one example can change: the Gram triangle (every
    entry, for a dense row), one class's sum (k) and one count."""
    if k < 1:
        raise ValueError(f"need k >= 1, got {k}")
    return (cf.triangle_size(k) if gram else 0) + k + 1


def statistics_sensitivity(*, gram: bool = True) -> float:
    """The float-domain L2 sensitivity of the release to one example of norm <= 1:
    sqrt(3) with the second moment (lda, ridge), sqrt(2) without (fedcof)."""
    return cf.SENSITIVITY if gram else math.sqrt(2.0)


def statistics_clip(dataset_size: int) -> float:
    """The per-coordinate bound of one device's statistics (the quantiser's ``clip``):
    with at most ``dataset_size`` rows of norm <= 1, a count, a sum's coordinate and a Gram
    entry (``|x_i x_j| <= 1``) all lie within ``dataset_size`` of 0. Public: the declared
    bound, never the count held."""
    if dataset_size < 1:
        raise ValueError(f"dataset_size must be positive, got {dataset_size}")
    return float(dataset_size)


def kls_tau(share_sigma2: float, shares: int) -> float:
    """Kairouz-Liu-Steinke's ``tau = 10 sum_{k=1}^{m-1} exp(-2 pi^2 sigma_1^2 k/(k+1))``
    for ``m = shares`` draws of ``N_Z(0, share_sigma2)`` (0 for one share: one discrete
    Gaussian needs no correction)."""
    if share_sigma2 <= 0 or shares < 1:
        raise ValueError(f"need share_sigma2 > 0 and shares >= 1, got {share_sigma2}, {shares}")
    terms = (math.exp(-2 * math.pi**2 * share_sigma2 * k / (k + 1)) for k in range(1, shares))
    return 10.0 * math.fsum(terms)


def rdp_epsilon(rdp: Sequence[float], delta: float) -> float:
    """``(epsilon, delta)`` of a mechanism whose Renyi divergence at each of
    :data:`RDP_ORDERS` is at most ``rdp``: the least over the orders of
    ``r + ln(1 - 1/alpha) - (ln delta + ln alpha) / (alpha - 1)`` (Balle et al. 2020,
    Thm. 21). An order whose divergence is NaN bounds nothing and is passed over, as
    Opacus does; infinite when none bounds it. The device's ledger reads its history here
    too (edge_agent/privacy/accounting.py)."""
    _check_delta(delta)
    if len(rdp) != len(RDP_ORDERS):
        raise ValueError(f"{len(rdp)} Renyi divergences for {len(RDP_ORDERS)} orders")
    log_delta = math.log(delta)
    return min(
        (
            float(r) + math.log1p(-1.0 / a) - (log_delta + math.log(a)) / (a - 1.0)
            for a, r in zip(RDP_ORDERS, rdp, strict=True)
            if not math.isnan(r)
        ),
        default=math.inf,
    )


def zcdp_epsilon(rho: float, delta: float, *, xi: float = 0.0) -> float:
    """``(xi, rho)``-zCDP as ``(epsilon, delta)``-DP: its divergence of order ``alpha`` is at
    most ``xi + rho alpha`` (Bun and Steinke 2016, Def. 1.1), read by :func:`rdp_epsilon`,
    or Bun and Steinke's closed form ``xi + rho + 2 sqrt(rho ln(1/delta))`` (their Prop. 1.3
    and Lemma 3.5) where that is less: only where the best order lies beyond
    :data:`RDP_ORDERS`, epsilons below about 0.3 at delta 1e-5. Both are valid bounds."""
    if rho < 0 or xi < 0:
        raise ValueError(f"rho and xi must be non-negative, got {rho}, {xi}")
    _check_delta(delta)
    closed = xi + rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))
    return min(rdp_epsilon([xi + rho * a for a in RDP_ORDERS], delta), closed)


def zcdp_for_epsilon(epsilon: float, delta: float) -> float:
    """The largest ``rho`` (to a relative 1e-12, below it) whose :func:`zcdp_epsilon`
    (``xi = 0``) is at most ``epsilon``: bisection, the epsilon rising with ``rho`` from 0
    (the closed form's, at ``rho = 0``), so there is one."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be positive and finite, got {epsilon}")
    _check_delta(delta)
    low, high = 0.0, epsilon
    while zcdp_epsilon(high, delta) <= epsilon:
        low, high = high, 2.0 * high
    while high - low > 1e-12 * high:
        mid = (low + high) / 2.0
        if zcdp_epsilon(mid, delta) <= epsilon:
            low = mid
        else:
            high = mid
    return low


@dataclass(frozen=True, kw_only=True)
class SecureSum:
    """The public facts of one release through secure aggregation.

    ``sensitivity``: float-domain L2 sensitivity to one example; ``support``: how many
    coordinates one example can change; ``length``: ``d``; ``scale``: the quantiser's
    ``gamma``; ``threshold``: ``T``, the fewest survivors a round may finish with (the
    fleet's quorum; the complete graph's ``t``);
    ``colluding``: ``c``, how many devices may share their noise with the coordinator."""

    sensitivity: float
    support: int
    length: int
    scale: float
    threshold: int
    colluding: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sensitivity) and self.sensitivity > 0):
            raise ValueError(f"sensitivity must be positive and finite, got {self.sensitivity}")
        if not 1 <= self.support <= self.length:
            raise ValueError(f"support {self.support} must lie in [1, length = {self.length}]")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be positive and finite, got {self.scale}")
        if self.threshold < 1:
            raise ValueError(f"threshold must be at least 1, got {self.threshold}")
        if not 0 <= self.colluding < self.threshold:
            raise ValueError(
                f"{self.colluding} colluding devices leave no honest share of t = "
                f"{self.threshold}: the noise would all be known to the coordinator"
            )

    @classmethod
    def of_statistics(
        cls, *, k: int, classes: int, scale: float, threshold: int, colluding: int = 0,
        gram: bool = True,
    ) -> SecureSum:  # fmt: skip
        """A closed-form release of ``k``-dimensional statistics over ``classes``."""
        return cls(
            sensitivity=statistics_sensitivity(gram=gram),
            support=example_support(k, gram=gram),
            length=statistics_length(k, classes=classes, gram=gram),
            scale=scale,
            threshold=threshold,
            colluding=colluding,
        )

    @property
    def honest(self) -> int:
        """``m = t - c``: the shares the guarantee rests on."""
        return self.threshold - self.colluding

    @property
    def units_sensitivity(self) -> float:
        """``Delta = gamma * S + sqrt(support)``: the integer-domain L2 sensitivity."""
        return self.scale * self.sensitivity + math.sqrt(self.support)

    @property
    def inflation(self) -> float:
        """What the rounding adds to the sensitivity, as a ratio (``Delta / (gamma S)``)."""
        return self.units_sensitivity / (self.scale * self.sensitivity)

    def honest_sigma2(self, sigma2: float) -> float:
        """The noise parameter the honest shares add up to: ``m sigma^2 / t``."""
        return self.honest * sigma2 / self.threshold

    def zcdp(self, sigma2: float) -> tuple[tuple[float, float], tuple[float, float]]:
        """Both ``(xi, rho)`` bounds of KLS Prop. 14 at a total parameter ``sigma2``
        (units^2): ``(tau d, x^2 / 2)`` and ``(0, (x + sqrt(d) tau)^2 / 2)``."""
        if not (math.isfinite(sigma2) and sigma2 > 0):
            raise ValueError(f"sigma2 must be positive and finite, got {sigma2}")
        tau = kls_tau(sigma2 / self.threshold, self.honest)
        x = self.units_sensitivity / math.sqrt(self.honest_sigma2(sigma2))
        return (tau * self.length, x * x / 2), (0.0, (x + math.sqrt(self.length) * tau) ** 2 / 2)

    def epsilon(self, sigma2: float, *, delta: float) -> float:
        """Epsilon at ``delta`` of the sum with total parameter ``sigma2`` (units^2),
        whatever ``s >= t`` devices survive and whichever ``c`` collude."""
        return min(zcdp_epsilon(rho, delta, xi=xi) for xi, rho in self.zcdp(sigma2))

    def equivalent_multiplier(self, sigma2: float) -> float:
        """``sqrt(m sigma^2 / t) / Delta``: the continuous Gaussian's noise multiplier with
        the same sensitivity and honest noise (the independent check's input)."""
        return math.sqrt(self.honest_sigma2(sigma2)) / self.units_sensitivity


@dataclass(frozen=True)
class DistributedPlan:
    """A calibrated release: ``sigma2`` (an integer, units^2) is the fleet's parameter,
    what the sum of ``t`` shares carries (``SecAggSettings.sigma2``); each device adds
    ``N_Z(0, sigma2 / t)``. ``epsilon`` is what the plan spends (<= the target)."""

    release: SecureSum
    sigma2: int
    epsilon: float
    delta: float

    @property
    def share_sigma2(self) -> float:
        return self.sigma2 / self.release.threshold

    def sum_std(self, survivors: int) -> float:
        """The noise's standard deviation per coordinate of the decoded (float) sum of
        ``survivors`` devices, at most: ``sqrt(s sigma^2 / t) / gamma``."""
        if survivors < self.release.threshold:
            raise ValueError(f"{survivors} survivors: a round needs t = {self.release.threshold}")
        return math.sqrt(survivors * self.share_sigma2) / self.release.scale


def plan_distributed(*, release: SecureSum, epsilon_target: float, delta: float) -> DistributedPlan:
    """The smallest integer ``sigma2`` whose sum spends at most ``epsilon_target``.

    Start from the closed form with ``tau = 0``: ``rho`` from :func:`zcdp_for_epsilon`,
    ``m sigma^2 / t = Delta^2 / (2 rho)``; round up; then, only if ``tau`` is not
    negligible (a share of a few units), double and bisect until the bound holds."""
    rho = zcdp_for_epsilon(epsilon_target, delta)
    need = release.units_sensitivity**2 / (2 * rho) * release.threshold / release.honest
    low = max(1, math.ceil(need))
    if release.epsilon(low, delta=delta) > epsilon_target:
        high = 2 * low
        while release.epsilon(high, delta=delta) > epsilon_target:
            low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) // 2
            if release.epsilon(mid, delta=delta) > epsilon_target:
                low = mid
            else:
                high = mid
        low = high
    return DistributedPlan(release, low, release.epsilon(low, delta=delta), delta)


def decoded_noise_std(*, spec: QuantiseSpec, plan: DistributedPlan | None, devices: int) -> float:
    """The standard deviation, at most, of what the decoded sum of ``devices`` devices
    carries on each coordinate beyond their clipped inputs: the plan's noise (None: no
    noise) and the stochastic rounding's, each device's error of mean 0 and variance
    ``p (1 - p) <= 1/4`` units, so ``sqrt(devices) / (2 gamma)`` over the sum. Public: the
    solve floors the directions it swamps (closed_form/heads.py::lda_head). Without the
    rounding's share a noise-off sum at k 512 lost 0.7 points to the exact one (issue 56):
    its rounding, 5e-4 a coordinate, is above the within-class scatter's narrowest
    directions too."""
    if devices < 1:
        raise ValueError(f"a sum of {devices} devices")
    rounding = math.sqrt(devices) / (2.0 * spec.scale)
    if plan is None:
        return rounding
    return math.hypot(plan.sum_std(max(devices, plan.release.threshold)), rounding)


def ring_headroom(plan: DistributedPlan, devices: int) -> int:
    """The integer room the noise of ``devices`` shares needs: ``NOISE_TAILS`` standard
    deviations of the summed parameter (a discrete Gaussian is ``sigma^2``-subgaussian,
    so it passes them with probability below ``2 exp(-NOISE_TAILS^2 / 2)`` per coordinate,
    about 4e-22 for 10)."""
    return math.ceil(NOISE_TAILS * math.sqrt(devices * plan.share_sigma2))


def check_ring(plan: DistributedPlan, *, spec: QuantiseSpec, devices: int) -> None:
    """Refuse a ring the sum of ``devices`` clipped, scaled inputs plus the noise's tail
    could wrap: ``devices * ceil(clip * scale) + headroom <= 2^(bits-1) - 1``. Wrapping
    costs no privacy (it is post-processing), only the sum. ``spec.scale`` must be the
    plan's."""
    if spec.scale != plan.release.scale:
        raise ValueError(f"the ring's scale {spec.scale} is not the plan's {plan.release.scale}")
    if devices < plan.release.threshold:
        raise ValueError(
            f"{devices} devices: fewer than the threshold t = {plan.release.threshold}"
        )
    headroom = ring_headroom(plan, devices)
    fits = max_devices(spec=spec, headroom=headroom)
    if devices > fits:
        raise ValueError(
            f"a {spec.bits}-bit ring holds the sum of at most {fits} devices at clip "
            f"{spec.clip:g} and scale {spec.scale:g} with {NOISE_TAILS} noise standard "
            f"deviations ({headroom:,} units) spare, not {devices}: lower the scale, widen "
            f"the ring or split the fleet"
        )


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
