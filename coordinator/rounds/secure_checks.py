"""A secure fleet's unmasked sum, checked before its head is solved: no device's input is
ever seen, so the fleet's running sum after a round is held to what that many devices
could hold together (coordinator/statistics_checks.py with the bounds summed): total
counts non-negative and within the devices' public bounds (``secure_aggregation
.dataset_size`` each, the quantiser's clip), class sums within their counts, a trace within
the samples and a positive semi-definite second moment, each within ``Z`` standard
deviations of the sum's noise (the plan's, public) and its rounding (the quantiser's step).

What one enrolled device can still do inside these bounds is in docs/privacy.md: each of
its coordinates is clipped to ``dataset_size`` in the ring, so it can add any statistics a
device of ``dataset_size`` samples could hold, labels flipped included."""

from __future__ import annotations

import math

import closed_form as cf
from closed_form.triangles import upper_triangle
from coordinator.statistics_checks import StatisticsBounds, statistics_problem
from secagg.fleet import SecureRelease


def sum_noise_std(release: SecureRelease, devices: int) -> float:
    """The standard deviation, per coordinate, of what a sum of ``devices`` inputs carries
    beside the statistics: the plan's noise and each input's rounding to the quantiser's
    step (uniform, variance ``1 / (12 scale^2)``)."""
    spec = release.settings.spec
    noise = 0.0 if release.plan is None else release.plan.sum_std(
        max(devices, release.plan.release.threshold)
    )  # fmt: skip
    return math.sqrt(noise**2 + devices / (12.0 * spec.scale**2))


def sum_problem(stats: cf.Statistics, release: SecureRelease) -> str | None:
    """Why the fleet's summed ``stats`` cannot be the sum of ``stats.devices`` devices'
    statistics (a rejection reason), or None."""
    if stats.devices <= 0:
        return None
    bounds = StatisticsBounds(
        max_samples=stats.devices * release.settings.spec.clip,
        sigma=sum_noise_std(release, stats.devices),
    )
    gram = None if stats.gram is None else upper_triangle(stats.gram)
    return statistics_problem(stats.counts, stats.sums, gram, bounds)
