"""Timing helpers for the project's benchmarks (``make bench``).

Benchmarks report ratios of two timings taken side by side in one process; the minimum
over repeats is used because it is the least disturbed by other work on the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from statistics import median


def seconds_per_call(fn: Callable[[], object], *, repeat: int = 5, min_time: float = 0.05) -> float:
    """Best-of-``repeat`` seconds per call, each repeat looping for at least ``min_time``."""
    number = 1
    while True:  # calibrate the loop count so one repeat lasts at least min_time
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            break
        number *= 2
    best = elapsed / number
    for _ in range(repeat - 1):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def paired_seconds(
    calls: dict[str, Callable[[], object]], *, rounds: int = 15, min_time: float = 0.3
) -> dict[str, list[float]]:
    """Seconds per call of every entry of ``calls``, measured in ``rounds`` rounds that
    each time every call once, back to back, the order reversed every other round.

    On a machine others share, the load changes between seconds, not within one round:
    the ratio of two calls' times within a round (see :func:`paired_ratio`) cancels it,
    and reversing the order cancels a drift across the round. Each entry is called once
    first, as a warm-up, and each measurement loops for at least ``min_time``."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            number, start = 0, time.perf_counter()
            while True:
                calls[name]()
                number += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_time:
                    break
            times[name].append(elapsed / number)
    return times


def paired_ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """Median over rounds of ``times[slow] / times[fast]`` taken in the same round."""
    return median(a / b for a, b in zip(times[slow], times[fast], strict=True))
