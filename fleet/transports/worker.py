"""A worker process of a simulated fleet: hosts many agents, one MQTT session each.

``python -m fleet.transports.worker SPEC.json`` where the spec names the bundle and the agents'
TOML files. Every agent gets its own :class:`~edge_agent.service.AgentService` (its own paho client and thread); all share one
set of ONNX Runtime sessions and one torch thread, so a hundred agents fit on two cores.
SIGTERM or SIGINT stops every agent cleanly (offline status published) and exits 0; so
does the death of the fleet process named in the spec (``parent``), however it dies.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from edge_agent.agent import Agent
from edge_agent.config import load
from edge_agent.service import AgentService
from export.runtime import BackboneRuntime, RuntimeSettings
from fleet.engine.evaluation import FleetEvaluator
from fleet.transports.tether import tether
from runtime.lifecycle import SignalDispatch

log = logging.getLogger("fleet.transports.worker")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if len(argv) != 1:
        print("usage: python -m fleet.transports.worker SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    stop = threading.Event()
    services: list[AgentService] = []

    def on_signal(signum: int) -> None:  # in the dispatch thread
        stop.set()
        for service in list(services):
            service.stop()

    with SignalDispatch({signal.SIGTERM: on_signal, signal.SIGINT: on_signal}):
        if "parent" in spec and not tether(int(spec["parent"])):
            log.warning("the fleet process that started this worker is gone: not starting")
            return 1
        return _host(spec, stop, services)


def _host(spec: dict[str, Any], stop: threading.Event, services: list[AgentService]) -> int:
    torch.set_num_threads(1)
    runtime = BackboneRuntime(Path(spec["bundle"]), settings=RuntimeSettings(intra_op_threads=1))
    threads = []
    for path in spec["configs"]:
        if stop.is_set():
            break
        agent = Agent(load(Path(path)), runtime=runtime, evaluator=FleetEvaluator)
        service = AgentService(agent=agent)
        services.append(service)
        thread = threading.Thread(target=service.run, name=service.cfg.agent_id, daemon=True)
        thread.start()
        threads.append(thread)
    log.info("worker hosts %d agents", len(services))
    stop.wait()
    for service in services:  # one started as the stop came in was not in the list yet
        service.stop()
    for thread in threads:
        thread.join(timeout=60)
    log.info("worker stopped %d agents", len(services))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
