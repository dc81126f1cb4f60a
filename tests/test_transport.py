"""The MQTT client helpers every service shares (``runtime/transport.py``)."""

from __future__ import annotations

import threading
import time

import pytest

from fleet.transports.broker import free_port
from runtime.transport import (
    MqttSettings,
    TakeoverWatch,
    connect_failure,
    make_client,
    start_network,
)


@pytest.mark.slow
def test_the_first_retry_comes_after_the_delay_the_service_set():
    # After a failed first attempt paho's own thread waited the delay twice (1 s, then
    # 2 s): an agent that logged "reconnecting in 1 s" tried again after 3.
    settings = MqttSettings(host="127.0.0.1", port=free_port())
    client = make_client(settings, "early")
    failures: list[tuple[float, str]] = []
    twice = threading.Event()

    def failed(c, userdata):
        failures.append((time.monotonic(), connect_failure(settings)))
        c.reconnect_delay_set(min_delay=1, max_delay=60)  # as the services' retry does
        if len(failures) == 2:
            twice.set()

    client.on_connect_fail = failed
    start_network(client, settings)
    try:
        assert twice.wait(timeout=30)
    finally:
        client.loop_stop()
    (first, why_first), (second, why_second) = failures[:2]
    assert 0.9 < second - first < 2.5
    # The first failure, made outside paho's thread, still says why.
    assert (
        why_first
        == why_second
        == (f"cannot reach the broker at 127.0.0.1:{settings.port} (Connection refused)")
    )


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
