"""The real agents of the fault matrix (bench/fault_matrix_bench.py, issue 53): an lda
fleet of digits-5 devices on the small zoo, set up by edge-fleet's own machinery
(fleet/transports/runner.py::fleet_tables: signed, each agent its TOML file, data split
and state directory) and hosted as edge-fleet's mqtt transport hosts them (``python -m
fleet.transports.worker``: every agent its own AgentService and paho session, one set of
ONNX Runtime sessions per process). One host process per group of devices, its agents
pointed at the group's port: the broker's, or a fault proxy's.

lda because the worker tier runs it (coordinator/tier/owner.py::refusal: a closed-form
method over workers needs ``closed_form.count_cap = 0``, which edge-fleet's tables set)
and because its devices send their statistics once and then an update with no rows each
round: a receipt for the statistics is one a device acts on for good.

What the devices were told is stored comes from their side, two ways:

- :class:`ReceiptTap`: every receipt the workers sent, heard on the devices' receipt
  topics by a persistent session (its queue survives the broker's restarts);
- :func:`stored_statistics`: each agent's own state. Once a receipt names its statistics
  update, the agent records ``statistics_stored`` and never sends them again
  (edge_agent/delivery.py): that update must be in a worker's database, and in the
  owner's total once its round closed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt

from closed_form.projection import PROJECTION
from coordinator.service.owner_service import receipt_filter
from edge_agent.state import StateDir
from export import bundle as bundle_mod
from fleet.data.partition import digits5
from fleet.transports.configs import merged_tables, workers_refusal, write_config
from fleet.transports.hosts import host_command
from fleet.transports.mqtt import AGENTS_PER_WORKER
from fleet.transports.progress import progress_bar
from fleet.transports.runner import fleet_tables
from fleet.transports.spec import FLEET, RunSpec
from fleet.transports.watcher import Watcher
from protocol import ProtocolError
from protocol.receipts import Receipt

METHOD = "lda"
HOST = "127.0.0.1"
#: The public projection of the statistics (edge-fleet's ``--stats-dim``), not its 512:
#: at 512 every device's statistics update is 1 MB (a 512-d second moment), and 300 of
#: them at once leave this shared 2-core machine checking statistics for minutes, a
#: figure of its CPU, not of the faults. The path each update takes is the same.
STATS_DIM = 64
#: Images per device (digits-5, feature split), as bench/mqtt_fleet_bench.py's.
TRAIN = TEST = 20

Key = tuple[str, int, str]  # (run, round, client)


@dataclass(frozen=True)
class Group:
    """``devices`` agents in one host process, reaching the broker at ``port``."""

    name: str
    devices: int
    port: int

    def __post_init__(self) -> None:
        # paho's select() loop: more agents than this in one process never connect
        # (fleet/transports/mqtt.py says why).
        if not 0 < self.devices <= AGENTS_PER_WORKER:
            raise ValueError(
                f"group {self.name}: 1..{AGENTS_PER_WORKER} agents, got {self.devices}"
            )


class AgentFleet:
    """The fleet's files under ``out`` (the layout of fleet/transports/layout.py), made at
    construction; :meth:`start` starts one host process per group."""

    def __init__(
        self, out: Path, *, bundle: Path, groups: Sequence[Group], broker_port: int,
        coordinator: dict[str, object],
    ) -> None:  # fmt: skip
        """``coordinator``: tables merged over edge-fleet's coordinator tables."""
        self.groups = tuple(groups)
        self.spec = RunSpec(method=METHOD, rounds=1, bundle=bundle.absolute(), out=out.absolute(),
                            transport="mqtt", coordinator_workers=2, stats_dim=STATS_DIM,
                            progress=False)  # fmt: skip
        layout = self.spec.layout
        partition = digits5(clients=sum(g.devices for g in groups), split="feature", seed=0,
                            train=TRAIN, test=TEST)  # fmt: skip
        agents, coord = fleet_tables(self.spec, partition, bundle_mod.load(self.spec.bundle))
        coord = merged_tables(
            coord, {"mqtt": {"host": HOST, "port": broker_port, "keepalive": 60}}, coordinator
        )
        refused = workers_refusal(coord)
        if refused is not None:
            raise RuntimeError(refused)
        self.config = write_config(layout.coordinator_config, coord)
        self.logs = layout.logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.names = list(agents)
        first = 0
        for index, group in enumerate(self.groups):
            mine = self.names[first : first + group.devices]
            first += group.devices
            mqtt_table = {"host": HOST, "port": group.port, "keepalive": 60}
            configs = [
                write_config(layout.agent_config(n), {**agents[n], "mqtt": mqtt_table})
                for n in mine
            ]
            # The worker's spec as fleet/transports/mqtt.py writes it: tethered to this
            # process, so a benchmark that dies takes its agents with it.
            layout.worker_spec(index).write_text(json.dumps({
                "bundle": str(self.spec.bundle), "configs": [str(c) for c in configs],
                "parent": os.getpid(),
            }))  # fmt: skip
        self.hosts: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        layout = self.spec.layout
        for index in range(len(self.groups)):
            argv, env = host_command(layout.worker_spec(index))
            with layout.worker_log(index).open("wb") as log:
                self.hosts.append(subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                ))  # fmt: skip

    def alive(self) -> None:
        for index, host in enumerate(self.hosts):
            if host.poll() is not None:
                raise RuntimeError(
                    f"agent host {index} exited ({host.returncode}); see "
                    f"{self.spec.layout.worker_log(index)}"
                )

    def wait_online(self, port: int, tick: Callable[[], None]) -> None:
        """Until every agent has said it is online; ``tick`` about once a second (a check
        that raises when a process died, as :meth:`alive`)."""
        watcher = Watcher(HOST, port, expected=len(self.names))
        try:
            with progress_bar(self.spec, len(self.names), "agents online", "agent") as bar:
                watcher.wait_online(bar, tick)
        finally:
            watcher.close()

    def pids(self) -> list[int]:
        return [h.pid for h in self.hosts if h.poll() is None]

    def stop(self) -> None:
        """SIGTERM: each host stops its agents cleanly (offline status published)."""
        for host in self.hosts:
            if host.poll() is None:
                host.send_signal(signal.SIGTERM)
        for host in self.hosts:
            try:
                host.wait(timeout=120)
            except subprocess.TimeoutExpired:
                host.kill()
                host.wait()

    def stored_statistics(self) -> dict[Key, str]:
        """(run, round, client) of each agent's statistics update that a receipt named, as
        the agent's state records it -> the data version; agents whose statistics no
        receipt named are left out."""
        out: dict[Key, str] = {}
        for name in self.names:
            extra = StateDir(
                self.spec.layout.agent_state(name), agent_id=name, create=False
            ).snapshot.extra
            stored, sent = extra.get("statistics_stored"), extra.get("statistics_sent")
            # stored_as = f"{version}@{run}/{PROJECTION}" (edge_agent/delivery.py)
            suffix = f"/{PROJECTION}"
            if not (isinstance(sent, dict) and stored == sent.get("version")):
                continue
            if not isinstance(stored, str) or not stored.endswith(suffix):
                continue
            version, run = stored[: -len(suffix)].rsplit("@", 1)
            out[(run, int(sent["round"]), name)] = version
        return out


class ReceiptTap:
    """Every receipt (not refusal) the coordinator's workers send the fleet's devices:
    (run, round, client) -> the digest it names."""

    def __init__(self, port: int) -> None:
        self.receipts: dict[Key, str] = {}
        self._lock = threading.Lock()
        # A persistent session (clean_session False) on a persistent broker: receipts sent
        # while this client reconnects after a broker restart wait in its queue.
        self._client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id="fault-matrix-tap", clean_session=False
        )
        self._client.max_inflight_messages_set(1000)
        self._client.reconnect_delay_set(min_delay=1, max_delay=2)  # paho's default max is 120 s
        subscribed = threading.Event()
        self._client.on_subscribe = lambda *_: subscribed.set()
        self._client.on_connect = self._on_connect
        self._client.on_message = self._on_message
        self._client.connect(HOST, port)
        self._client.loop_start()
        if not subscribed.wait(60):
            raise TimeoutError("no SUBACK for the receipt tap")

    def _on_connect(self, *_: object) -> None:
        self._client.subscribe(receipt_filter(FLEET), qos=1)

    def _on_message(self, _c: object, _u: object, message: mqtt.MQTTMessage) -> None:
        try:
            receipt = Receipt.from_wire(message.payload, max_bytes=len(message.payload))
        except ProtocolError:
            return
        if receipt.fleet == FLEET and not receipt.refused:
            with self._lock:
                self.receipts[(receipt.run, receipt.round, receipt.client)] = receipt.digest

    def close(self) -> dict[Key, str]:
        self._client.loop_stop()
        self._client.disconnect()
        with self._lock:
            return dict(self.receipts)
