"""Timing helpers for the project's benchmarks (``make bench``).

Benchmarks report ratios of two timings taken side by side in one process; the minimum
over repeats is used because it is the least disturbed by other work on the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable


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
