"""MQTT brokers a simulated fleet (and the test suite) can start on this machine.

Mosquitto is preferred when it is installed; the pure-Python amqtt broker is the fallback
so a laptop without Mosquitto still runs a fleet. Both bind to a free loopback port.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from fleet.transports import tether
from protocol.limits import BROKER_MAX_PACKET_SIZE

#: The limits of the shipped production broker configuration
#: (systemd/mosquitto/protofleet.conf; tests/test_broker.py checks that the two agree), so
#: a simulated fleet meets the queues and packet size a deployed one does. Mosquitto's
#: default of 1000 queued messages per client silently drops a burst of updates.
PRODUCTION_LIMITS = {
    "max_packet_size": BROKER_MAX_PACKET_SIZE,
    "max_queued_messages": 10_000,
    "max_inflight_messages": 100,
}

_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/opt/homebrew/sbin")


class BrokerError(RuntimeError):
    """A broker could not be started or did not become ready in time."""


def find_mosquitto() -> str | None:
    """Path of the mosquitto binary: PATH first, then the sbin folders packages use."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for folder in _SBIN_DIRS:
        candidate = Path(folder) / "mosquitto"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(
    host: str, port: int, *, timeout: float, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Block until ``host:port`` accepts TCP connections, or raise :class:`BrokerError`."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise BrokerError(f"broker exited with status {process.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"nothing listening on {host}:{port} after {timeout:.0f} s"
                ) from None
            time.sleep(0.02)  # poll interval of a bounded wait for the listener


def _wait_until_listening(process: subprocess.Popen[bytes], port: int, *, timeout: float) -> None:
    """Block until ``process`` itself holds the listening socket on ``port``: what answered
    :func:`wait_for_port` may be another process's listener on a port taken in the
    meantime, and then ours exits with "Address already in use". Linux only (/proc); a
    no-op elsewhere."""
    deadline = time.monotonic() + timeout
    while True:
        owned = _listens(process.pid, port)
        if owned is None or owned:
            return
        if process.poll() is not None:
            raise BrokerError(f"port {port} is in use by another process")
        if time.monotonic() > deadline:
            raise BrokerError(f"port {port} answered, but not from the broker, for {timeout:.0f} s")
        time.sleep(0.02)  # poll interval of a bounded wait for the listener


def _listens(pid: int, port: int) -> bool | None:
    """Whether ``pid`` holds a listening TCP socket on ``port``; None where /proc cannot say."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError):
                for line in Path(table).read_text().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except (OSError, ValueError, IndexError):
        return None
    return any(f"socket:[{inode}]" in links for inode in inodes)


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


B = TypeVar("B", bound="ManagedBroker")


class ManagedBroker:
    """A broker this process starts and stops: ``with Broker() as b: b.address``."""

    @property
    def address(self) -> BrokerAddress:
        raise NotImplementedError

    def start(self: B) -> B:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: B) -> B:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _keep_identity() -> str:
    """A ``user`` line naming whoever runs this process.

    Started as root, Mosquitto otherwise switches to the user ``mosquitto``. That change of
    credentials would cancel its tether (the kernel clears a parent-death signal on any
    credential change), and a private broker has nobody else to be: its files lie in a
    directory this process made.
    """
    try:
        return f"user {pwd.getpwuid(os.geteuid()).pw_name}\n"
    except KeyError:  # a uid with no passwd entry (some containers): Mosquitto's default
        return ""


def _raise_file_limit(pid: int) -> None:
    """Lift the broker's soft limit on open files to its hard limit. Mosquitto holds one
    descriptor per client and does not raise the limit itself: under the common soft
    limit of 1,024 a fleet of 1,000 agents, its coordinator and watcher, its listener and
    log come within a few descriptors of it, and one client more is refused."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # not Linux; not ours
        _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))


class MosquittoBroker(ManagedBroker):
    """A private Mosquitto on a free loopback port, stopped on exit.

    ``extra_config`` lines are appended to the generated configuration; ``config`` replaces
    it entirely (tests run the shipped deployment configuration this way; it must then
    listen on ``port``).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_config: str = "",
        listener_config: str | None = None,
        config: str | None = None,
        binary: str | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        found = binary or find_mosquitto()
        if found is None:
            raise BrokerError("mosquitto is not installed (Debian: apt-get install mosquitto)")
        self._binary = found
        self._host = host
        self._port = port or free_port(host)
        # A port picked here may be taken by another process before Mosquitto binds it
        # (parallel test workers, a busy host): then another is picked, a few times.
        self._may_move = port is None and listener_config is None and config is None
        self._extra = extra_config
        self._listener = listener_config
        self._config = config
        self._timeout = startup_timeout
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> BrokerAddress:
        return BrokerAddress(self._host, self._port)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path:
        assert self._dir is not None
        return Path(self._dir.name) / "mosquitto.log"

    def config_text(self) -> str:
        if self._config is not None:
            return self._config
        listener = self._listener or f"listener {self._port} {self._host}\nallow_anonymous true\n"
        limits = "".join(f"{key} {value}\n" for key, value in PRODUCTION_LIMITS.items())
        return (
            f"{listener}"
            "persistence false\n"
            f"{limits}"
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
            f"{_keep_identity()}"
            f"{self._extra}"
        )

    def start(self) -> MosquittoBroker:
        for attempt in range(3):
            try:
                return self._start()
            except BrokerError as exc:
                if not (self._may_move and attempt < 2 and "in use" in str(exc)):
                    raise
                self._port = free_port(self._host)
        raise AssertionError("unreachable: the last attempt raises")

    def _start(self) -> MosquittoBroker:
        self._dir = tempfile.TemporaryDirectory(prefix="protofleet-mosquitto-")
        conf = Path(self._dir.name) / "mosquitto.conf"
        conf.write_text(self.config_text())
        log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            # Tethered: a SIGKILLed owner (test runner, edge-fleet) leaves no broker behind.
            tether.command(os.getpid(), [self._binary, "-c", str(conf)]),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        _raise_file_limit(self._process.pid)
        try:
            wait_for_port(self._host, self._port, timeout=self._timeout, process=self._process)
            _wait_until_listening(self._process, self._port, timeout=self._timeout)
        except BrokerError as exc:
            self.stop()
            raise BrokerError(f"{exc}; mosquitto said: {self._tail()}") from exc
        return self

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except (OSError, AssertionError):
            return ""

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
