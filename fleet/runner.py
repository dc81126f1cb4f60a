"""Run one simulated fleet: the real agent and coordinator code, over MQTT or in memory.

``mqtt``: a broker (Mosquitto from PATH, else amqtt in-process, or ``--broker URL``),
``edge-coordinator run`` as its own process, and the agents hosted in a few worker
processes (``python -m fleet.worker``), each agent with its own state directory and MQTT
session, all agents of a worker sharing one set of ONNX Runtime sessions.

``memory``: the same :class:`~edge_agent.agent.Agent` and
:class:`~coordinator.rounds.RoundManager` (with its SQLite store) in this process, the
messages handed over as the same wire bytes, for sweeps with 1,000 clients.

Either way every agent evaluates itself on its own test split each round and keeps the
record in its state directory; :func:`collect` reads the run back from those records and
the coordinator's database.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from edge_agent.train_config import TrainConfig
from fleet import tether
from fleet.partition import ClientData, Partition
from fleet.procmem import FleetMemory, peak_self_mb, reset_peak
from runtime.cliutil import CommandFailed, Terminated, UsageError
from runtime.faults import crash_point
from runtime.lifecycle import SignalDispatch
from runtime.settings import ConfigError, build

log = logging.getLogger(__name__)

FLEET = "sim"
TRANSPORTS = ("mqtt", "memory")


@dataclass(frozen=True)
class RunSpec:
    method: str
    rounds: int
    bundle: Path
    out: Path  # this run's folder
    seed: int = 0
    transport: str = "mqtt"
    broker: str | None = None  # mqtt://host:port of an external broker
    workers: int = 2
    out_dim: int = 256
    epochs: int = 1
    progress: bool = True
    extra_train: dict[str, Any] = field(default_factory=dict)
    privacy: dict[str, Any] = field(default_factory=dict)  # the agents' [privacy] table
    # Mechanism noise replayable from the seed: for experiments that must repeat to the
    # bit; it voids every guarantee (the agents and reports say so). Secret otherwise.
    reproducible_noise: bool = False
    # Shared by every run that sees the same images (the methods of a compare): the
    # backbones then run once per image, not once per method.
    feature_cache: Path | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise UsageError(f"--transport must be one of {', '.join(TRANSPORTS)}")
        if self.rounds < 1 or self.workers < 1 or self.epochs < 1:
            raise UsageError("--rounds, --workers and --epochs must be at least 1")
        if self.out_dim < 1:
            raise UsageError(f"--out-dim must be at least 1, got {self.out_dim}")
        # The agents build the same table from their TOML file: a bad value fails here,
        # before a fleet starts, not in every worker process.
        try:
            build(TrainConfig, train_table(self), prefix="train.")
        except ConfigError as exc:
            raise UsageError(f"--train-param {exc}") from None


def train_table(spec: RunSpec) -> dict[str, Any]:
    """The agents' [train] table of a run."""
    return {"out_dim": spec.out_dim, "epochs": spec.epochs, **spec.extra_train}


@dataclass(frozen=True)
class ClientRecord:
    name: str
    domain: str
    accuracy: tuple[float | None, ...]  # per round, by the method's own inference rule
    accuracy_prototype: tuple[float | None, ...]  # per round, cosine to local prototypes
    accuracy_classifier: tuple[float | None, ...]  # per round, the linear classifier
    bytes_up: tuple[int, ...]
    bytes_down: tuple[int, ...]


@dataclass(frozen=True)
class RunResult:
    spec: RunSpec
    clients: tuple[ClientRecord, ...]
    round_seconds: tuple[float, ...]
    peak_mb: float
    wall_seconds: float
    backbone_samples: int | None = None  # images the backbones ran on (memory transport)


# -- configuration files ---------------------------------------------------------------------


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string


def to_toml(tables: dict[str, Any]) -> str:
    """Top-level keys first, then one ``[table]`` per dict value (one level deep)."""
    lines = [f"{k} = {toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for name, table in tables.items():
        if isinstance(table, dict):
            lines.append(f"[{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _agent_tables(
    spec: RunSpec, client: ClientData, root: Path, classes: tuple[str, ...], index: int
) -> dict[str, Any]:
    from edge_agent.agent import AVERAGED  # torch: only when a fleet is set up

    train, test = client.save(root / "data")
    return {
        "agent_id": client.name,
        "fleet": FLEET,
        "state_dir": str(root / "state"),
        "bundle": str(spec.bundle),
        "method": spec.method,
        "classes": list(classes),
        "seed": spec.seed * 100_003 + index,
        # Averaged models start from one head, as a server-initialised model would; every
        # other method's devices start apart, as independent devices do.
        **({"init_seed": spec.seed} if spec.method in AVERAGED else {}),
        # The report reads every round back from state.json: none may be dropped.
        "history": max(200, spec.rounds),
        "data": {
            "train": str(train),
            "test": str(test),
            **(
                {"feature_cache": str(spec.feature_cache), "shared_feature_cache": True}
                if spec.feature_cache
                else {}
            ),
        },
        "train": train_table(spec),
        # One intra-op thread per session: many agents share a few cores.
        "runtime": {"intra_op_threads": 1, "inter_op_threads": 1},
        **(_privacy_tables(spec, index) if spec.privacy else {}),
    }


def _privacy_tables(spec: RunSpec, index: int) -> dict[str, Any]:
    seed = (
        {"reproducible_noise_seed": spec.seed * 100_003 + index} if spec.reproducible_noise else {}
    )
    return {"privacy": {**spec.privacy, **seed}}


def prototype_dim(spec: RunSpec, feature_dim: int) -> int:
    """What the agents' updates carry: head embeddings, or (dp-features) backbone features."""
    return feature_dim if spec.privacy.get("mechanism") == "dp-features" else spec.out_dim


def _coordinator_tables(
    spec: RunSpec,
    bundle_id: str,
    classes: tuple[str, ...],
    clients: int,
    *,
    dim: int,
    feature_dim: int,
) -> dict[str, Any]:
    return {
        "fleet": FLEET,
        "state_dir": str(spec.out / "coordinator"),
        "sqlite_synchronous": "NORMAL",
        "model": {
            "method": spec.method,
            "bundle": bundle_id,
            "classes": list(classes),
            "dim": dim,
            # With the classes they fix the weights FedAvg and FPL devices send.
            "feature_dim": feature_dim,
            "norm": train_table(spec).get("norm", "batch"),
        },
        "rounds": {
            "min_clients": clients,
            "wait_after_quorum_s": 0.0,
            "timeout_s": 3600.0,
            "max_rounds": spec.rounds,
        },
    }


@dataclass(frozen=True)
class FleetKeys:
    """Ed25519 keys of a simulated fleet, so it runs the signed path a deployment runs:
    ``coordinator.key`` and ``.pub``, ``agents/<name>.key``, ``devices/<name>.pub`` (the
    coordinator's enrolment folder)."""

    root: Path

    def agent_table(self, name: str) -> dict[str, Any]:
        return {
            "key": str(self.root / "agents" / f"{name}.key"),
            "coordinator": str(self.root / "coordinator.pub"),
        }

    def coordinator_table(self) -> dict[str, Any]:
        return {"key": str(self.root / "coordinator.key"), "devices": str(self.root / "devices")}


def fleet_keys(root: Path, names: list[str]) -> FleetKeys:
    """Make the keys a run lacks; a resumed run keeps its own (its stored updates are
    signed with them)."""
    from runtime.keyfiles import generate_ed25519

    if not (root / "coordinator.key").exists():
        generate_ed25519(root / "coordinator.key", root / "coordinator.pub")
    for name in names:
        if not (root / "agents" / f"{name}.key").exists():
            generate_ed25519(root / "agents" / f"{name}.key", root / "devices" / f"{name}.pub")
    return FleetKeys(root)


# -- running -----------------------------------------------------------------------------------


def run(spec: RunSpec, partition: Partition) -> RunResult:
    from export import bundle as bundle_mod
    from export.errors import BundleError

    try:
        bundle = bundle_mod.load(spec.bundle)
    except BundleError as exc:
        raise UsageError(str(exc)) from exc
    # The agents' and coordinator's files hold absolute paths: a relative one in a config
    # file is read from that file's folder, not from here.
    spec = replace(
        spec,
        out=spec.out.absolute(),
        bundle=spec.bundle.absolute(),
        feature_cache=spec.feature_cache and spec.feature_cache.absolute(),
    )
    spec.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    agents: list[dict[str, Any]] = []
    keys = fleet_keys(spec.out / "keys", [c.name for c in partition.clients])
    for i, client in enumerate(partition.clients):
        tables = _agent_tables(
            spec, client, spec.out / "clients" / client.name, partition.classes, i
        )
        tables["security"] = keys.agent_table(client.name)
        # Written for both transports: reports and users can reopen any agent from it.
        (spec.out / "clients" / client.name / "agent.toml").write_text(to_toml(tables))
        agents.append(tables)
    coord = _coordinator_tables(spec, bundle.id, partition.classes, len(agents),
                                dim=prototype_dim(spec, bundle.feature_dim),
                                feature_dim=bundle.feature_dim)  # fmt: skip
    coord["security"] = keys.coordinator_table()
    samples = None
    if spec.transport == "memory":
        peak, samples = _run_memory(spec, agents, coord)
    else:
        peak = _run_mqtt(spec, agents, coord)
    result = collect(spec, partition, peak_mb=peak, wall=time.perf_counter() - started)
    return replace(result, backbone_samples=samples)


def _progress(spec: RunSpec, total: int, desc: str, unit: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        leave=False,
        disable=not spec.progress or None,
        file=sys.stderr,
        dynamic_ncols=True,
    )


#: Both transports' payload cap. FedPCL's announcement carries every client's padded local
#: set (Eq. 7), about 10 kB per client, so a 100-agent fleet's exceeds the 1 MB default;
#: FedAvg's update carries the head, FC(K*d_e, 256): 1.3 MB over a 1280-d backbone.
FLEET_MAX_PAYLOAD_BYTES = 256 << 20


def _run_memory(
    spec: RunSpec, agents: list[dict[str, Any]], coord: dict[str, Any]
) -> tuple[float, int]:
    import torch

    from coordinator.config import CoordinatorConfig
    from coordinator.metrics import Metrics
    from coordinator.rounds import RoundManager
    from coordinator.store import Store
    from edge_agent.agent import Agent
    from edge_agent.config import AgentConfig
    from export.runtime import BackboneRuntime, RuntimeSettings
    from protocol import RoundAnnouncement
    from runtime.settings import build

    torch.set_num_threads(1)
    reset_peak()
    runtime = BackboneRuntime(spec.bundle, settings=RuntimeSettings(intra_op_threads=1))
    live = []
    with _progress(spec, len(agents), f"{spec.method}: starting agents", "agent") as bar:
        for tables in agents:
            live.append(Agent(build(AgentConfig, tables), runtime=runtime))
            bar.update()
    cfg = build(
        CoordinatorConfig, {**coord, "mqtt": {"max_payload_bytes": FLEET_MAX_PAYLOAD_BYTES}}
    )
    store = Store(cfg.database, synchronous=cfg.sqlite_synchronous)
    try:
        manager = RoundManager(config=cfg, store=store, metrics=Metrics())
        with _progress(spec, spec.rounds, f"{spec.method}: rounds", "round") as bar:
            while True:
                wire = manager.announcement.to_wire()
                announcement = RoundAnnouncement.from_wire(wire, max_bytes=len(wire))
                for agent in live:
                    decision = agent.handle(announcement, received_bytes=len(wire))
                    if decision.payload is not None:
                        outcome = manager.offer(decision.payload, topic_client=agent.cfg.agent_id)
                        if not outcome.accepted:
                            raise RuntimeError(
                                f"the coordinator rejected {agent.cfg.agent_id}: {outcome.reason}"
                            )
                        agent.state.mark_published(announcement.round)
                if manager.done:
                    break
                if manager.poll() is None:
                    raise RuntimeError(f"round {announcement.round} did not close")
                bar.update()
                _log_round(spec, announcement.round + 1)
                # Durability tests stop a sweep here, mid-run, as a crash would.
                crash_point(f"fleet:{spec.method}:round_closed")
    finally:
        store.close()
    return peak_self_mb(), runtime.samples_processed


def _log_round(spec: RunSpec, done: int) -> None:
    # Progress bars are off when stderr is no terminal (CI, journald, a test); this line
    # (shown with --log-level INFO) tells such a reader how far the run is.
    log.info("%s: round %d of %d closed", spec.method, done, spec.rounds)


def parse_broker_url(url: str) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"mqtt://{url}")
    if parsed.scheme not in ("mqtt", "tcp") or not parsed.hostname:
        raise UsageError(f"--broker must look like mqtt://host:port, got {url!r}")
    try:
        port = parsed.port or 1883
    except ValueError as exc:
        raise UsageError(f"--broker {url!r}: {exc}") from exc
    return parsed.hostname, port


@contextmanager
def broker_for(spec: RunSpec) -> Iterator[tuple[str, int, int | None]]:
    """(host, port, broker pid or None): the external broker, else Mosquitto, else amqtt."""
    if spec.broker:
        host, port = parse_broker_url(spec.broker)
        yield host, port, None
        return
    from fleet.amqtt_broker import AmqttBroker
    from fleet.broker import BrokerError, MosquittoBroker, find_mosquitto

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


def _run_mqtt(spec: RunSpec, agents: list[dict[str, Any]], coord: dict[str, Any]) -> float:
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
    spec: RunSpec, agents: list[dict[str, Any]], coord: dict[str, Any], stop: _StopRequest
) -> float:
    bin_dir = Path(sys.executable).parent
    logs = spec.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    with broker_for(spec) as (host, port, broker_pid):
        mqtt = {"host": host, "port": port, "keepalive": 60,
                "max_payload_bytes": FLEET_MAX_PAYLOAD_BYTES}  # fmt: skip
        coord_cfg = spec.out / "coordinator.toml"
        coord_cfg.write_text(to_toml({**coord, "mqtt": mqtt}))
        configs = []
        for tables in agents:
            path = Path(tables["state_dir"]).parent / "agent.toml"
            path.write_text(to_toml({**tables, "mqtt": mqtt}))
            configs.append(path)
        workers = min(spec.workers, len(configs))
        memory = FleetMemory()
        if broker_pid is not None:
            memory.pids.append(broker_pid)
        try:
            watcher = _Watcher(host, port, expected=len(configs))
            procs.append(
                _spawn(
                    tether.command(
                        os.getpid(),
                        [str(bin_dir / "edge-coordinator"), "run", "--config", str(coord_cfg)],
                    ),
                    logs / "coordinator.log",
                )
            )
            for w in range(workers):
                spec_file = logs / f"worker-{w}.json"
                spec_file.write_text(
                    json.dumps(
                        {
                            "bundle": str(spec.bundle),
                            "configs": [str(c) for c in configs[w::workers]],
                            "parent": os.getpid(),
                        }
                    )
                )
                procs.append(
                    _spawn(
                        [sys.executable, "-m", "fleet.worker", str(spec_file)],
                        logs / f"worker-{w}.log",
                    )
                )
            coordinator = procs[0]
            memory.pids += [p.pid for p in procs]
            named = {"the coordinator": (procs[0], logs / "coordinator.log")}
            named |= {f"worker {w}": (p, logs / f"worker-{w}.log") for w, p in enumerate(procs[1:])}
            alive = _liveness(named, memory.sample, stop.check)
            with _progress(spec, len(configs), f"{spec.method}: agents online", "agent") as bar:
                watcher.wait_online(bar, alive)
            log.info("%s: %d agents online", spec.method, len(configs))
            with _progress(spec, spec.rounds, f"{spec.method}: rounds", "round") as bar:
                watcher.wait_rounds(spec.rounds, bar, alive, lambda r: _log_round(spec, r))
            # The coordinator exits by itself once it has announced the last round.
            del named["the coordinator"]
            watcher.wait_finished(_liveness(named, memory.sample, stop.check))
            memory.sample()
            if coordinator.wait(timeout=60) != 0:
                raise CommandFailed(f"the coordinator failed; see {logs / 'coordinator.log'}")
            watcher.close()
        finally:
            _stop_all(procs)
    for w, proc in enumerate(procs[1:]):
        if proc.returncode != 0:  # a worker stops with 0 after SIGTERM
            raise CommandFailed(f"a worker did not stop cleanly; see {logs / f'worker-{w}.log'}")
    return memory.peak_mb


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as handle:
        return subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
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


CONNECT_TIMEOUT_S = 10.0  # for the broker's answer to the watcher's first connection


class _Watcher:
    """Follows the fleet over MQTT: agents coming online, rounds being announced."""

    def __init__(self, host: str, port: int, *, expected: int) -> None:
        import paho.mqtt.client as mqtt

        from protocol import round_topic, status_filter

        self.expected = expected
        self.online: set[str] = set()
        self.finished: set[str] = set()
        self.round = -1
        self._cond = threading.Condition()
        self._client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"fleet-watcher-{os.getpid()}"
        )
        self._round_topic = round_topic(FLEET)
        topics = [(self._round_topic, 1), (status_filter(FLEET), 1)]
        answered = threading.Event()
        answers: list[Any] = []

        def on_connect(client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
            if not reason.is_failure:
                client.subscribe(topics)
            answers.append(reason)
            answered.set()

        self._client.on_connect = on_connect
        self._client.on_message = self._on_message
        # Connected before anything is started: a wrong --broker would otherwise leave the
        # fleet waiting, silent, for the 30-minute no-progress limit.
        where = f"the MQTT broker at {host}:{port}"
        try:
            self._client.connect(host, port)
        except OSError as exc:
            raise CommandFailed(f"cannot reach {where}: {exc.strerror or exc}") from exc
        self._client.loop_start()
        if not answered.wait(timeout=CONNECT_TIMEOUT_S):
            self.close()
            raise CommandFailed(
                f"{where} did not answer an MQTT connection within {CONNECT_TIMEOUT_S:g} s"
            )
        if answers[0].is_failure:
            self.close()
            raise CommandFailed(f"{where} refused the connection: {answers[0]}")

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        from protocol import FINISHED, AgentState, ProtocolError, RoundAnnouncement, Status

        try:
            if message.topic == self._round_topic:
                # No size cap: FedPCL's announcement to 200 agents (every padded local set)
                # is 2 MB, over the 1 MiB default, and ignoring it left the run waiting
                # until the coordinator's exit looked like a crash.
                ann = RoundAnnouncement.from_wire(message.payload, max_bytes=len(message.payload))
                with self._cond:
                    self.round = max(self.round, ann.round)
                    self._cond.notify_all()
            else:
                status = Status.from_wire(message.payload)
                with self._cond:
                    if status.state is AgentState.ONLINE:
                        self.online.add(status.client)
                        if status.reason == FINISHED:
                            self.finished.add(status.client)
                    self._cond.notify_all()
        except (ProtocolError, ValueError):
            return

    def _wait(
        self, done: Callable[[], bool], tick: Callable[[], None], alive: Callable[[], None]
    ) -> None:
        stalled_since = time.monotonic()
        seen = (self.round, len(self.online), len(self.finished))
        while True:
            with self._cond:
                progressed = self._cond.wait_for(done, timeout=1.0)
                tick()
                now = (self.round, len(self.online), len(self.finished))
            alive()  # also samples the fleet's memory, about once a second
            if progressed:
                return
            if now != seen:
                seen, stalled_since = now, time.monotonic()
            elif time.monotonic() - stalled_since > 1800:
                raise CommandFailed("the fleet made no progress for 30 minutes")

    def wait_online(self, bar: Any, alive: Callable[[], None]) -> None:
        def tick() -> None:
            bar.update(len(self.online) - bar.n)

        self._wait(lambda: len(self.online) >= self.expected, tick, alive)

    def wait_rounds(
        self, rounds: int, bar: Any, alive: Callable[[], None], closed: Callable[[int], None]
    ) -> None:
        """Until round ``rounds`` is announced; ``closed(n)`` once for each n rounds done."""

        reported = 0  # not bar.n: a disabled tqdm counts nothing

        def tick() -> None:
            nonlocal reported
            done = min(rounds, max(0, self.round))
            for n in range(reported + 1, done + 1):
                closed(n)
            reported = max(reported, done)
            bar.update(done - bar.n)

        self._wait(lambda: self.round >= rounds, tick, alive)

    def wait_finished(self, alive: Callable[[], None]) -> None:
        """Until every agent has handled the final announcement (and written what it
        scores there, such as FedAvg's last global-model accuracy)."""
        self._wait(lambda: len(self.finished) >= self.expected, lambda: None, alive)

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


# -- results -----------------------------------------------------------------------------------


def collect(spec: RunSpec, partition: Partition, *, peak_mb: float, wall: float) -> RunResult:
    """Read the run back from every agent's state.json and the coordinator's database."""
    records = []
    for client in partition.clients:
        state_file = spec.out / "clients" / client.name / "state" / "state.json"
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError) as exc:
            raise CommandFailed(f"no record of {client.name}: {exc}") from exc
        by_round = {h["round"]: h for h in state.get("history", [])}
        rows = [by_round.get(r, {}) for r in range(spec.rounds)]
        records.append(
            ClientRecord(
                name=client.name,
                domain=client.domain,
                accuracy=tuple(h.get("test_accuracy") for h in rows),
                accuracy_prototype=tuple(h.get("test_accuracy_prototype") for h in rows),
                accuracy_classifier=tuple(h.get("test_accuracy_classifier") for h in rows),
                bytes_up=tuple(int(h.get("bytes_up") or 0) for h in rows),
                bytes_down=tuple(int(h.get("bytes_down") or 0) for h in rows),
            )
        )
    db = sqlite3.connect(
        f"file:{spec.out / 'coordinator' / 'coordinator.sqlite3'}?mode=ro", uri=True
    )
    try:
        rows = db.execute(
            "SELECT round, opened_at, closed_at FROM rounds WHERE round < ? ORDER BY round",
            (spec.rounds,),
        ).fetchall()
    finally:
        db.close()
    # A round's wall time runs from its announcement to the next one (closing = opening).
    opened = {r: t for r, t, _ in rows}
    seconds = []
    for r, t, closed in rows:
        end = closed if closed is not None else opened.get(r + 1)
        seconds.append(float(end - t) if end is not None else float("nan"))
    return RunResult(spec, tuple(records), tuple(seconds), peak_mb, wall)
