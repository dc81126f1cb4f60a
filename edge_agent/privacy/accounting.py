"""Privacy accounting: every DP-SGD step and every prototype release of an agent, composed.

A history is a list of :class:`Event` (noise multiplier, sampling rate, count) — the form
both of Opacus's accountants take — so one agent's whole life composes in one place:

- DP-SGD: ``Event(sigma_sgd, q = batch / dataset_size, steps)`` (Poisson-subsampled
  Gaussian; ``dataset_size`` is the declared public bound, see :func:`sgd_schedule`);
- a release: the per-class sums (L2 sensitivity 1: every ``z`` has norm 1) and the counts
  (sensitivity 1) noised with ``sigma_sum`` and ``sigma_count``. Together they are one
  Gaussian mechanism on the vector (sum, count) whose RDP is
  ``alpha / 2 * (1 / sigma_sum^2 + 1 / sigma_count^2)``, i.e. a Gaussian with the
  effective multiplier ``(sigma_sum^-2 + sigma_count^-2)^-1/2``: ``Event(sigma_eff, 1, 1)``.

RDP composes by adding per order; epsilon at delta is Opacus's conversion, read by
:func:`secagg.plan.rdp_epsilon` (the secure sum's plan's). PRV (Gopi et
al.) is selectable and usually tighter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from secagg.plan import RDP_ORDERS, rdp_epsilon

ACCOUNTANTS = ("rdp", "prv")


@dataclass(frozen=True)
class Event:
    noise_multiplier: float
    sample_rate: float
    count: int
    kind: str = "sgd"  # "sgd" or "release": for reports only

    def __post_init__(self) -> None:
        if self.noise_multiplier <= 0 or not 0 < self.sample_rate <= 1 or self.count < 0:
            raise ValueError(f"invalid privacy event {self}")

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate, "count": self.count}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Event:
        return cls(
            noise_multiplier=float(data["noise_multiplier"]),  # type: ignore[arg-type]
            sample_rate=float(data["sample_rate"]),  # type: ignore[arg-type]
            count=int(data["count"]),  # type: ignore[call-overload]
            kind=str(data.get("kind", "sgd")),
        )


def effective_sigma(sigma_sum: float, sigma_count: float) -> float:
    """The single Gaussian multiplier equivalent to noising sums and counts (both
    sensitivity 1) with these multipliers."""
    return float((sigma_sum**-2 + sigma_count**-2) ** -0.5)


def per_part_sigma(effective: float) -> float:
    """The multiplier for sums and for counts (the same for both) that makes the release
    a Gaussian mechanism with multiplier ``effective``: the inverse of
    :func:`effective_sigma` with equal parts."""
    return effective * math.sqrt(2)


def release_event(sigma_sum: float, sigma_count: float) -> Event:
    return Event(effective_sigma(sigma_sum, sigma_count), 1.0, 1, kind="release")


def gaussian_release(noise_multiplier: float) -> Event:
    """One Gaussian mechanism of ``noise_multiplier`` (noise std over its joint L2
    sensitivity) over a whole release: a closed-form method's statistics."""
    return Event(noise_multiplier, 1.0, 1, kind="release")


def orders() -> list[float]:
    """The Renyi orders the ledger reads epsilon at, Opacus's defaults: the secure sum's
    plan reads the same (:data:`secagg.plan.RDP_ORDERS`), so a device prices a secure
    round as its plan does."""
    return list(RDP_ORDERS)


@functools.lru_cache(maxsize=4096)
def _event_rdp(noise_multiplier: float, sample_rate: float, count: int) -> tuple[float, ...]:
    # Opacus's subsampled-Gaussian series costs milliseconds per call; an agent's rounds
    # repeat the same few events, so the ledger re-prices its history from this cache.
    from opacus.accountants.analysis.rdp import compute_rdp

    return tuple(
        np.asarray(
            compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=count,
                        orders=orders())
        )
    )  # fmt: skip


def rdp(history: Sequence[Event], alphas: Sequence[float] | None = None) -> np.ndarray:
    """RDP of the composed history at each order (the sum over events)."""
    if alphas is not None and list(alphas) != orders():
        from opacus.accountants.analysis.rdp import compute_rdp

        total = np.zeros(len(alphas))
        for e in history:
            if e.count:
                total += np.asarray(compute_rdp(q=e.sample_rate, noise_multiplier=e.noise_multiplier,
                                                steps=e.count, orders=list(alphas)))  # fmt: skip
        return total
    total = np.zeros(len(orders()))
    for e in history:
        if e.count:
            total += np.asarray(_event_rdp(e.noise_multiplier, e.sample_rate, e.count))
    return total


def epsilon(history: Sequence[Event], *, delta: float, accountant: str = "rdp") -> float:
    """Epsilon spent by ``history`` at ``delta`` (0 for an empty history)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    events = [e for e in history if e.count]
    if not events:
        return 0.0
    if accountant == "rdp":
        # The secure sum's plan's own reading (Opacus's conversion, at the same orders), so
        # a device charges a secure round what its plan says the round costs.
        return rdp_epsilon(rdp(events).tolist(), delta)
    if accountant == "prv":
        from opacus.accountants import PRVAccountant

        prv = PRVAccountant()
        prv.history = [(e.noise_multiplier, e.sample_rate, e.count) for e in events]
        return float(prv.get_epsilon(delta=delta))
    raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")


# -- calibration -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """DP-SGD's sampling for one round, from public settings only (:func:`sgd_schedule`)."""

    sample_rate: float
    steps: int  # per round
    expected_batch: int  # the divisor of the summed noisy gradient (loss_reduction="mean")


def sgd_schedule(*, dataset_size: int, batch: int, epochs: int) -> Schedule:
    """DP-SGD's sample rate and steps per round from the declared data-set bound.

    ``dataset_size`` is the declared upper bound on a device's training set, never its
    private count: q = batch / dataset_size and epochs * ceil(dataset_size / batch) steps
    a round, whatever the device holds. A smaller set is still sampled with the same q
    (its batches are smaller, some empty), so the steps, the accountant's events, the
    gradient's scale and the epsilon every update carries are the same for any data
    within the bound: the count itself is never released through them.
    """
    if dataset_size < 1 or batch < 1 or epochs < 1:
        raise ValueError("dataset_size, batch and epochs must be positive")
    q = min(1.0, batch / dataset_size)
    return Schedule(q, epochs * math.ceil(dataset_size / batch), min(batch, dataset_size))


@dataclass(frozen=True)
class Plan:
    sgd_noise_multiplier: float
    sample_rate: float
    sgd_steps: int
    release_noise_multiplier: float  # effective (sum and count combined)
    releases: int
    epsilon: float
    delta: float
    accountant: str

    @property
    def release_sum_sigma(self) -> float:
        return per_part_sigma(self.release_noise_multiplier)

    def history(self) -> list[Event]:
        s = self.release_sum_sigma
        sgd = (
            [Event(self.sgd_noise_multiplier, self.sample_rate, self.sgd_steps)]
            if self.sgd_steps
            else []
        )
        return [*sgd, *[release_event(s, s)] * self.releases]


def _solve(
    target: float, f: Callable[[float], float], *, low: float = 0.05, high: float = 500.0
) -> float:
    """The smallest multiplier in [low, high] whose epsilon is <= target (bisection on a
    decreasing function)."""
    if f(high) > target:
        raise ValueError(
            f"an epsilon of {target:g} (for this part of the run) is out of reach even with "
            f"noise multiplier {high:g}: raise --epsilon or lower --rounds"
        )
    for _ in range(60):
        mid = math.sqrt(low * high)
        if f(mid) > target:
            low = mid
        else:
            high = mid
        if high / low < 1.0005:
            break
    return high


def _check_budget(epsilon_target: float, delta: float) -> None:
    if epsilon_target <= 0:
        raise ValueError(f"epsilon must be positive, got {epsilon_target:g}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta:g}")


def plan(
    *,
    epsilon_target: float,
    delta: float,
    rounds: int,
    epochs: int,
    dataset_size: int,
    batch: int,
    release_share: float = 0.2,
    accountant: str = "rdp",
) -> Plan:
    """Noise multipliers that spend ``epsilon_target`` over the whole run of the ``dp``
    mechanism: the releases alone are sized to spend ``release_share`` of it, DP-SGD gets
    the rest (found with the releases composed in). Every input is public."""
    _check_budget(epsilon_target, delta)
    if rounds < 1:
        raise ValueError("rounds must be positive")
    if not 0 < release_share < 1:
        raise ValueError(f"release share must be in (0, 1), got {release_share}")
    schedule = sgd_schedule(dataset_size=dataset_size, batch=batch, epochs=epochs)
    q, steps = schedule.sample_rate, rounds * schedule.steps

    def releases_eps(sigma: float) -> float:
        return epsilon([Event(sigma, 1.0, rounds, "release")], delta=delta, accountant=accountant)

    sigma_rel = _solve(epsilon_target * release_share, releases_eps)

    def total_eps(sigma: float) -> float:
        history = [Event(sigma, q, steps), Event(sigma_rel, 1.0, rounds, "release")]
        return epsilon(history, delta=delta, accountant=accountant)

    sigma_sgd = _solve(epsilon_target, total_eps)
    final = total_eps(sigma_sgd)
    return Plan(sigma_sgd, q, steps, sigma_rel, rounds, final, delta, accountant)


def plan_features(
    *, epsilon_target: float, delta: float, releases: int = 1, accountant: str = "rdp"
) -> Plan:
    """The release multiplier of the ``dp-features`` mechanism: ``releases`` Gaussian
    releases (one per data version the budget is to cover) that together spend
    ``epsilon_target``. No training step is accounted: the head never leaves the device."""
    _check_budget(epsilon_target, delta)
    if releases < 1:
        raise ValueError("releases must be positive")

    def releases_eps(sigma: float) -> float:
        return epsilon([Event(sigma, 1.0, releases, "release")], delta=delta, accountant=accountant)

    sigma = _solve(epsilon_target, releases_eps)
    return Plan(0.0, 1.0, 0, sigma, releases, releases_eps(sigma), delta, accountant)
