"""The ``mqtt`` transport: a broker (Mosquitto from PATH, else amqtt in-process, or
``--broker URL``), ``edge-coordinator run`` as its own process (with
``--coordinator-workers N``, as the round owner over N ``edge-coordinator worker``
processes: docs/scale.md), and the agents hosted in a few worker processes (``python -m
fleet.transports.worker``), each agent with its own state directory and MQTT session, all
agents of a worker sharing one set of ONNX Runtime sessions."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from coordinator.config import WorkersSettings
from fleet.transports import tether
from fleet.transports.amqtt_broker import AmqttBroker
from fleet.transports.broker import BrokerError, MosquittoBroker, find_mosquitto
from fleet.transports.configs import workers_refusal, write_config
from fleet.transports.hosts import host_command
from fleet.transports.layout import RunLayout
from fleet.transports.procmem import FleetMemory
from fleet.transports.progress import log_round, progress_bar
from fleet.transports.spec import RunSpec
from fleet.transports.watcher import Watcher
from runtime.cliutil import CommandFailed, Terminated, UsageError
from runtime.lifecycle import SignalDispatch

log = logging.getLogger(__name__)


def parse_broker_url(url: str) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"mqtt://{url}")
    if parsed.scheme not in ("mqtt", "tcp") or not parsed.hostname:
        raise UsageError(f"--broker must look like mqtt://host:port, got {url!r}")
    try:
        port = parsed.port or 1883
    except ValueError as exc:
        raise UsageError(f"--broker {url!r}: {exc}") from exc
    return parsed.hostname, port


#: The most agents one worker process hosts. paho waits on a client's sockets with
#: select(), which cannot watch a descriptor numbered 1,024 or more, and each agent holds
#: three (its connection and paho's wake-up pair): an agent past that never connects, and
#: the fleet would wait for it until the no-progress limit. 300 leaves room for the
#: process's own files.
AGENTS_PER_WORKER = 300


def workers_for(agents: int, asked: int) -> int:
    """Worker processes for ``agents``: ``asked`` (at most one per agent), or more when
    that would put over :data:`AGENTS_PER_WORKER` agents in one."""
    needed = -(-agents // AGENTS_PER_WORKER)
    if needed > asked:
        log.warning(
            "%d agents need %d worker processes (at most %d agents each), not %d",
            agents, needed, AGENTS_PER_WORKER, asked,
        )  # fmt: skip
    return max(min(asked, agents), needed)


def broker_refusal(spec: RunSpec) -> str | None:
    """Why the broker ``spec`` would run on cannot serve its coordinator workers, or None."""
    if spec.coordinator_workers is None or spec.broker or find_mosquitto() is not None:
        return None
    # amqtt speaks MQTT 3.1.1 alone: a worker's session is MQTT 5, for the shared
    # subscription that splits the updates among the workers.
    return (
        "--coordinator-workers needs MQTT 5 shared subscriptions, which the embedded amqtt "
        "broker does not have: install mosquitto (or give --broker)"
    )


def coordinator_worker_log(layout: RunLayout, name: str) -> Path:
    """The log of coordinator worker ``name``, beside the coordinator's."""
    return layout.logs / f"coordinator-{name}.log"


@contextmanager
def broker_for(spec: RunSpec) -> Iterator[tuple[str, int, int | None]]:
    """(host, port, broker pid or None): the external broker, else Mosquitto, else amqtt."""
    if spec.broker:
        host, port = parse_broker_url(spec.broker)
        yield host, port, None
        return
    refused = broker_refusal(spec)
    if refused is not None:
        raise UsageError(refused)
    broker: Any
    if find_mosquitto() is not None:
        broker = MosquittoBroker()
    else:
        log.warning("mosquitto not found on PATH: using the embedded amqtt broker")
        broker = AmqttBroker()
    try:
        broker.start()
    except BrokerError as exc:
        raise CommandFailed(str(exc)) from exc
    try:
        pid = broker.pid if isinstance(broker, MosquittoBroker) else None
        yield broker.address.host, broker.address.port, pid
    finally:
        broker.stop()


class _StopRequest:
    """Ctrl-C and SIGTERM during an MQTT run, taken as a request that the run acts on at
    its next check (about once a second) instead of as an exception raised wherever the
    main thread happens to be.

    Why: a KeyboardInterrupt raised inside ``Popen.poll`` between its taking and its
    releasing of the process's wait lock leaves the lock taken for good, and the clean-up's
    ``Popen.wait`` then blocks forever (seen: an ``edge-fleet`` hung after Ctrl-C, its
    Mosquitto a zombie). Signals the process was told to ignore stay ignored.
    """

    def __init__(self) -> None:
        self.signum: int | None = None

    def actions(self) -> dict[int, Callable[[int], None]]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # no signal handling off the main thread
        return {
            sig: self._record
            for sig in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(sig) is not signal.SIG_IGN
        }

    def _record(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        if self.signum == signal.SIGTERM:
            raise Terminated
        if self.signum is not None:
            raise KeyboardInterrupt


def run_mqtt(spec: RunSpec, agents: Mapping[str, dict[str, Any]], coord: dict[str, Any]) -> float:
    """Run the fleet of ``agents`` (each agent's tables by its name) and the coordinator of
    ``coord``; each configuration is written, with the broker's [mqtt] table, where the
    run's layout puts it. The peak of the fleet's summed resident memory, in MiB."""
    refused = workers_refusal(coord)  # before a broker or process starts
    if refused is not None:
        raise UsageError(refused)
    stop = _StopRequest()
    actions = stop.actions()
    try:
        with SignalDispatch(actions) if actions else nullcontext():
            peak = _run_mqtt_fleet(spec, agents, coord, stop)
    except Exception:
        stop.check()  # processes that ended on the same Ctrl-C: report the stop itself
        raise
    stop.check()  # a request after the last check still stops the command (a sweep)
    return peak


def _run_mqtt_fleet(
    spec: RunSpec, agents: Mapping[str, dict[str, Any]], coord: dict[str, Any], stop: _StopRequest
) -> float:
    coordinator_bin = str(Path(sys.executable).parent / "edge-coordinator")
    layout = spec.layout
    layout.logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    # What to call each process -> (process, its log), for the liveness check and the end.
    named: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}

    def start(
        what: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        proc = _spawn(argv, log_path, env=env)
        procs.append(proc)
        named[what] = (proc, log_path)
        return proc

    with broker_for(spec) as (host, port, broker_pid):
        # The deployed payload limits, as the memory transport's (fleet/transports/memory.py).
        mqtt = {"host": host, "port": port, "keepalive": 60}
        coord_cfg = write_config(layout.coordinator_config, {**coord, "mqtt": mqtt})
        configs = [
            write_config(layout.agent_config(name), {**tables, "mqtt": mqtt})
            for name, tables in agents.items()
        ]
        workers = workers_for(len(configs), spec.workers)
        memory = FleetMemory()
        if broker_pid is not None:
            memory.pids.append(broker_pid)
        try:
            watcher = Watcher(host, port, expected=len(configs))
            config_args = ["--config", str(coord_cfg)]

            def start_coordinator() -> subprocess.Popen[bytes]:
                coordinator = start(
                    "the coordinator",
                    tether.command(os.getpid(), [coordinator_bin, "run", *config_args]),
                    layout.coordinator_log,
                )
                # After the owner: a worker learns the open round from its retained
                # announcement (one that has not yet heard it refuses updates, which the
                # agents then resend).
                for name in WorkersSettings(count=spec.coordinator_workers or 0).members:
                    start(
                        f"coordinator worker {name}",
                        tether.command(
                            os.getpid(), [coordinator_bin, "worker", "--name", name, *config_args]
                        ),
                        coordinator_worker_log(layout, name),
                    )
                return coordinator

            # A secure fleet's round 0 is a secure-aggregation round whose first stage
            # opens with the announcement and closes at its deadline: the agents are
            # started first, so that the stage waits for their statistics, not for their
            # processes to start. Otherwise the coordinator first, as a deployment has it.
            if not spec.secure_aggregation:
                coordinator = start_coordinator()
            for w in range(workers):
                spec_file = layout.worker_spec(w)
                spec_file.write_text(
                    json.dumps(
                        {
                            "bundle": str(spec.bundle),
                            "configs": [str(c) for c in configs[w::workers]],
                            "parent": os.getpid(),
                        }
                    )
                )
                argv, env = host_command(spec_file)
                start(f"worker {w}", argv, layout.worker_log(w), env=env)
            memory.pids += [p.pid for p in procs]
            alive = _liveness(named, memory.sample, stop.check)
            with progress_bar(spec, len(configs), f"{spec.method}: agents online", "agent") as bar:
                watcher.wait_online(bar, alive)
            log.info("%s: %d agents online", spec.method, len(configs))
            if spec.secure_aggregation:
                started = len(procs)
                coordinator = start_coordinator()
                memory.pids += [p.pid for p in procs[started:]]
            with progress_bar(spec, spec.rounds, f"{spec.method}: rounds", "round") as bar:
                watcher.wait_rounds(spec.rounds, bar, alive, lambda r: log_round(spec, r))
            # The coordinator exits by itself once it has announced the last round; its
            # workers serve until stopped, as the agents' hosts do.
            del named["the coordinator"]
            watcher.wait_finished(_liveness(named, memory.sample, stop.check))
            memory.sample()
            if coordinator.wait(timeout=60) != 0:
                raise CommandFailed(f"the coordinator failed; see {layout.coordinator_log}")
            watcher.close()
        finally:
            _stop_all(procs)
    for what, (proc, log_path) in named.items():
        if proc.returncode != 0:  # a worker of either kind stops with 0 after SIGTERM
            raise CommandFailed(f"{what} did not stop cleanly; see {log_path}")
    return memory.peak_mb


def _spawn(
    argv: list[str], log_path: Path, *, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as handle:
        return subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )


def _liveness(
    named: dict[str, tuple[subprocess.Popen[bytes], Path]],
    sample: Callable[[], None],
    stop_check: Callable[[], None],
    *,
    grace_s: float = 5.0,
    may_finish: frozenset[str] = frozenset({"the coordinator"}),
) -> Callable[[], None]:
    """A check that raises :class:`CommandFailed` once any of ``named`` (what to call it ->
    (process, its log)) has exited: without it a dead coordinator or worker would leave the
    fleet waiting out the no-progress limit. An exit counts after ``grace_s``. A process in
    ``may_finish`` that exits with status 0 has finished, not failed: the coordinator ends
    once it has announced the last round, and with 200 agents answering, that message can
    reach the watcher many seconds later. ``stop_check`` raises for a Ctrl-C or SIGTERM
    received."""
    exited: dict[str, float] = {}

    def check() -> None:
        stop_check()
        sample()
        now = time.monotonic()
        for name, (proc, log_path) in named.items():
            if proc.poll() == 0 and name in may_finish:
                continue
            if proc.poll() is not None and now - exited.setdefault(name, now) >= grace_s:
                raise CommandFailed(
                    f"{name} exited early (status {proc.returncode}); see {log_path}"
                )

    return check


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
