"""Flower's half of the side-by-side benchmark: the shared workload (bench/peer_workload.py)
run through Flower's simulation engine, timed per round.

Flower is an optional extra (``pip install -e '.[peer]'``): without it the function says
so and returns None, and the benchmark records that it skipped rather than copy an old
figure.
The apps themselves live in bench/flower_apps.py, imported only once Flower is known to be
there.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.peer_workload import Workload

log = logging.getLogger(__name__)

# Flower's fastest setting found on the 2-core development machine, for 1,000 clients x
# 100 samples, D 256, C 10, one epoch of batch 32, torch one thread per actor (median
# s/round of rounds 2-3, one run each; other work shared the machine, load 6 to 26):
#   client CPUs 1    (2 actors), server threads  6 (Flower's default): 33.2
#   client CPUs 1    (2 actors), server threads 64:                     34.0
#   client CPUs 0.5  (4 actors), server threads  6:                     33.1
#   client CPUs 0.5  (4 actors), server threads 64:                     23.6  <- kept
#   client CPUs 0.25 (8 actors), server threads 64:                     24.6
# One client's fit alone (edge_agent.train on its 100 rows) takes 7 ms; the rest of a
# client's ~24 ms is Flower's round trip (message queues polled every 0.1 s, Ray calls),
# which more actors and more server threads in flight hide only together.

#: CPUs each Flower client (Ray actor) reserves: the pool holds cores / CLIENT_CPUS actors.
CLIENT_CPUS = 0.5
#: Threads of Flower's server, each carrying one client's round trip (see flower_apps).
SERVER_THREADS = 64


def missing_modules() -> list[str]:
    """The modules of Flower's simulation engine that are not installed (none: it runs)."""
    return [name for name in ("flwr", "ray") if importlib.util.find_spec(name) is None]


#: Ray's processes by name (``comm``, cut at 15 characters): its actors and daemons.
_RAY_NAMES = ("ray::", "raylet", "gcs_server")


def ray_processes() -> list[int]:
    """The Ray processes of this process's group still running, exited ones left out (a
    run in another terminal is not ours to wait for)."""
    group = os.getpgrp()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended as we looked
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        fields = rest.split()  # state, ppid, pgrp, ...; an exited one (Z) uses no core
        if fields[0] != "Z" and int(fields[2]) == group and comm.startswith(_RAY_NAMES):
            found.append(int(entry.name))
    return found


def wait_for_ray_to_exit(*, timeout_s: float = 60.0, poll_s: float = 0.2) -> None:
    """Return once the Ray processes of this group are gone. Flower returns from a
    simulation while its actors are still shutting down (four of them at about 40% of a
    core each, for a few seconds, development machine): whatever is timed next would
    share the cores with them."""
    deadline = time.monotonic() + timeout_s
    while (left := ray_processes()) and time.monotonic() < deadline:
        time.sleep(poll_s)  # polling another process's exit: there is no event to wait on
    if left:
        log.warning("%d Ray process(es) still running after %.0f s: %s", len(left),
                    timeout_s, left)  # fmt: skip


@dataclass(frozen=True)
class FlowerRounds:
    """What a Flower run gives the benchmark: each round's seconds and the global model
    (state-dict names to arrays) it ended with."""

    seconds: tuple[float, ...]
    weights: tuple[dict[str, np.ndarray], ...]


def flower_fedavg_rounds(
    workload: Workload,
    *,
    rounds: int,
    client_cpus: float = CLIENT_CPUS,
    server_threads: int = SERVER_THREADS,
) -> FlowerRounds | None:
    """``rounds`` FedAvg rounds with every client of ``workload`` taking part, or None
    when Flower's simulation engine is not installed.

    A round is timed by the strategy, from configure_fit to the end of aggregate_fit
    (bench/flower_apps.py: TimedFedAvg), since Flower reports no per-round time. Round 1
    also starts the actors and imports torch in each: the per-round figure leaves it out
    (``median_round_s(..., after_first=True)``), time to accuracy counts it.
    """
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    missing = missing_modules()
    if missing:
        log.warning(
            "Flower's simulation engine is not installed (%s missing; pip install -e "
            "'.[peer]'): the Flower comparison is skipped",
            ", ".join(missing),
        )
        return None
    # Flower and Ray report usage to their hosts unless told not to; a benchmark has no
    # business doing so. Both read these when imported or started, so set them first,
    # keeping any value the caller chose.
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from flwr.simulation import run_simulation

    # Lazy: flower_apps imports flwr, an optional extra that must see the settings above.
    from bench import flower_apps

    clock = flower_apps.RoundClock()
    with tempfile.TemporaryDirectory(prefix="protofleet-flower-") as tmp:
        where = flower_apps.spill(workload, Path(tmp))
        run_simulation(
            server_app=flower_apps.server_app(
                where,
                clients=workload.clients,
                rounds=rounds,
                clock=clock,
                server_threads=server_threads,
            ),
            client_app=flower_apps.client_app(where),
            num_supernodes=workload.clients,
            backend_config={"client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0}},
        )
    wait_for_ray_to_exit()
    if clock.failures or len(clock.seconds) != rounds or None in clock.parameters:
        raise RuntimeError(
            f"Flower ran {len(clock.seconds)} of {rounds} rounds with {clock.failures} "
            "failed client updates: no figure"
        )
    return FlowerRounds(
        seconds=tuple(clock.seconds),
        weights=tuple(flower_apps.named_weights(where, p) for p in clock.parameters if p),
    )
