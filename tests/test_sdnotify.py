"""systemd's notify protocol: datagrams to a socket this test binds, as systemd would."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.sdnotify import Notifier, Watchdog


class NotifySocket:
    """A bound AF_UNIX datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.address = address

    def receive(self, timeout: float = 10.0) -> str:
        self.sock.settimeout(timeout)
        return self.sock.recv(4096).decode()

    def wait_for(self, field: str, timeout: float = 30.0) -> list[str]:
        """Messages up to and including the first with the line ``field``."""
        seen = []
        while True:
            message = self.receive(timeout)
            seen.append(message)
            if field in message.splitlines():
                return seen


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(str(tmp_path / "notify.sock"))
    yield sock
    sock.sock.close()


def test_notifier_sends_key_value_lines(notify_socket: NotifySocket) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": notify_socket.address})
    assert notifier.enabled
    assert notifier.ready("serving")
    assert notify_socket.receive() == "READY=1\nSTATUS=serving"
    assert notifier.stopping()
    assert notify_socket.receive() == "STOPPING=1"


def test_abstract_socket_addresses_are_understood() -> None:
    name = f"@protofleet-test-{os.getpid()}"
    sock = NotifySocket(name)
    try:
        assert Notifier({"NOTIFY_SOCKET": name}).watchdog()
        assert sock.receive() == "WATCHDOG=1"
    finally:
        sock.sock.close()


def test_without_systemd_nothing_is_sent_and_nothing_fails(tmp_path: Path) -> None:
    assert not Notifier({}).ready()
    # A socket path that is gone (systemd restarted) is logged, not raised.
    assert not Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).ready()


def test_watchdog_interval_is_for_this_process_only() -> None:
    mine = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_interval_s == 30.0
    assert Notifier({**mine, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "junk"}).watchdog_interval_s is None


def test_watchdog_pings_only_while_healthy(notify_socket: NotifySocket) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "100000"})
    healthy = [True]
    dog = Watchdog(notifier=notifier, healthy=lambda: healthy[0])
    dog.start()
    try:
        assert notify_socket.receive() == "WATCHDOG=1"
        assert notify_socket.receive() == "WATCHDOG=1"
        healthy[0] = False
        # Drain a ping that may have been sent before the flip, then expect silence.
        with pytest.raises(TimeoutError):
            while True:
                notify_socket.receive(timeout=0.5)
    finally:
        dog.stop()
    assert dog.pings >= 2
