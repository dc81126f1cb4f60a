"""The paho-free parts of a connection every service shares (``runtime/transport.py``);
the connection itself is tested in tests/test_mqtt_link.py."""

from __future__ import annotations

import random

from runtime.transport import TakeoverWatch, backoff_delay


def test_backoff_waits_are_drawn_below_a_doubling_cap():
    # Full jitter: uniform in [low, min(high, low * 2^n)]; by hand, with low 1.5 and
    # high 10 the caps are 3, 6, 10 for attempts 1, 2, 3, and 10 from then on.
    class Top(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return b

    caps = [backoff_delay(n, low=1.5, high=10.0, rng=Top()) for n in (1, 2, 3, 4, 1000)]
    assert caps == [3.0, 6.0, 10.0, 10.0, 10.0]
    rng = random.Random(5)
    draws = [backoff_delay(2, low=1.5, high=10.0, rng=rng) for _ in range(200)]
    assert min(draws) >= 1.5 and max(draws) <= 6.0 and max(draws) - min(draws) > 3


def test_quick_drops_in_a_row_are_told_once_as_a_likely_takeover():
    now = [0.0]
    watch = TakeoverWatch(client_id="dev-a", quick_s=10.0, times=3, clock=lambda: now[0])

    def session(lasting: float) -> str | None:
        watch.connected()
        now[0] += lasting
        return watch.dropped()

    assert watch.dropped() is None  # no connection yet: a failed first attempt
    assert [session(2.0), session(9.9)] == [None, None]
    said = session(1.0)  # the third quick drop in a row
    assert said is not None and "is another client connected as 'dev-a'?" in said
    assert "3 connections in a row within 10 s" in said
    assert session(1.0) is None  # said once per run of quick drops
    assert session(60.0) is None  # a connection that held ends the run
    assert [session(3.0), session(3.0), session(3.0) is not None] == [None, None, True]
    assert watch.dropped() is None  # a second drop without a connection in between
