"""Secure aggregation at 1,000 and 10,000 devices, the real protocol in memory (issue 52).

Every device is the agent's own state machine (:class:`secagg.device.SecAggDevice`) of a
signed fleet: an Ed25519 key under a certificate of an in-memory fleet CA, its
advertisement signed, its neighbours' checked, the consistency stage's evidence checked
before any share leaves it, and its share of the distributed noise drawn by the exact
sampler. The coordinator is :class:`secagg.server.SecAggServer`. Every message goes
through its wire encoding on each side. The devices live in :data:`WORKERS` processes
(the round is stage by stage: they work while the coordinator waits, as on a fleet);
the coordinator's work runs in this one.

The calibrated plan, from public settings only: a tenth of the fleet may drop (``T =
0.9 n``, the fleet's quorum), a tenth of each neighbourhood (``t = ceil(0.9 (k + 1))``),
and ``c`` is the most colluders the neighbourhood rule ``2t > k + 1 + c`` admits (80 at
``k`` 100, 160 at 200; the complete graph of 1,000 takes SecAgg+'s 80 so that the two
carry the same noise). Each device adds ``sigma^2 / T`` of noise planned for epsilon
:data:`EPSILON` on ``T - c`` honest shares (secagg/plan.py). The vector is lda's
statistics at k :data:`K` (2,730 values, as bench.secagg_cost_bench), in a 32-bit ring at
1,000 devices and a 64-bit one at 10,000 (the plan refuses 32 bits there: the sum of
10,000 devices at the clip could wrap).

Keys, for each run ``<name>`` (``secaggplus_1000``, ``secagg_complete_1000``,
``secaggplus_10000``): ``fleet.<name>_bytes_per_device`` (the mean over devices of the
payload bytes each sent and received in the round), ``_bytes_per_device_max``,
``fleet.<name>_seconds`` (the coordinator's CPU seconds: taking, checking and relaying
every message, the consistency evidence, unmasking; decoding what it receives and
encoding what it sends), ``_device_seconds`` (a device's CPU seconds, the mean),
``_wall_s`` (the whole in-memory round on this machine's cores), ``_neighbours``,
``_threshold``, ``_quorum``, ``_colluding``, ``_evidence_draws`` (the entries a device
opens of the compact evidence; 0 where it gets every signature) and ``_length``.
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fleet.transports.fleet_ca import ca_certificate, device_certificate
from protocol.auth import Signer
from secagg.consistency import Consistency, Signatures, Survivors
from secagg.device import SecAggDevice
from secagg.enrolled import Enrolment
from secagg.evidence import openings
from secagg.fleet import SecureAggregation, secure_release
from secagg.messages import (
    Advertise,
    MaskedInput,
    RelayedShares,
    Roster,
    ShareKeys,
    Unmask,
)
from secagg.server import SecAggServer
from secagg.settings import SecAggSettings

FLEET, RUN = "scale", "scale-run"
K, CLASSES, DATASET = 64, 10, 50
EPSILON = 1.0
WORKERS = 2
#: (name, devices, neighbours; 0: the complete graph, colluding).
RUNS = (
    ("secaggplus_1000", 1000, 100, 80),
    ("secaggplus_10000", 10_000, 200, 160),
    ("secagg_complete_1000", 1000, 0, 80),
)
NOW = datetime.datetime(2026, 11, 28, tzinfo=datetime.timezone.utc)
_VALID = (NOW - datetime.timedelta(days=1), NOW + datetime.timedelta(days=30))
#: What a message may weigh here: a complete graph's relayed evidence can pass the
#: default cap (an MQTT fleet that large runs SecAgg+).
_MAX_BYTES = 1 << 28


def table(devices: int, neighbours: int, colluding: int) -> SecureAggregation:
    """The calibrated plan's table for ``devices`` (module text)."""
    group = devices if neighbours == 0 else neighbours + 1
    quorum = math.ceil(0.9 * devices)
    # A 32-bit ring holds 1,308 devices' sums at this clip and scale (secagg.plan.check_ring).
    return SecureAggregation(
        threshold=math.ceil(0.9 * group), neighbours=neighbours, colluding=colluding,
        quorum=quorum if neighbours else 0, epsilon=EPSILON, dataset_size=DATASET,
        bits=32 if devices <= 1000 else 64,
    )  # fmt: skip


def _worker(conn: Connection, names: list[str], settings: SecAggSettings, ca_key: bytes,
            ca_der: bytes, seed: int) -> None:  # fmt: skip
    """Devices ``names``, answering each stage's requests (client -> wire payload) with
    their answers' payloads; at ``stop``, their CPU seconds."""
    key = Ed25519PrivateKey.from_private_bytes(ca_key)
    ca = x509.load_der_x509_certificate(ca_der)
    devices = {}
    for c in names:
        own = Ed25519PrivateKey.generate()
        cert = device_certificate(key, ca, cn=c, public=own.public_key(), valid=_VALID)
        enrolment = Enrolment(client=c, signer=Signer(own), run=RUN, clock=NOW, ca=ca,
                              certificate=cert.public_bytes(serialization.Encoding.DER))  # fmt: skip
        devices[c] = SecAggDevice(client=c, fleet=FLEET, round=0, settings=settings,
                                  enrolment=enrolment)  # fmt: skip
    rng = np.random.default_rng(seed)
    vectors = {c: rng.uniform(0.0, 1.0, settings.length) for c in names}
    shared: list[tuple[str, ...]] = []

    def share(d: SecAggDevice, payload: bytes) -> Any:
        # Each device keeps its roster; 5,000 copies of 10,000 ids are 3 GB a process, so
        # the devices of one process share one copy of the list (a device holds its own).
        roster = Roster.from_wire(payload, max_bytes=_MAX_BYTES)
        if shared and roster.clients == shared[0]:
            roster = replace(roster, clients=shared[0])
        else:
            shared[:] = [roster.clients]
        return d.share(roster)

    steps: dict[str, Callable[[SecAggDevice, bytes], Any]] = {
        "advertise": lambda d, _: d.advertise(),
        "share": share,
        "masked": lambda d, p: d.masked_input(
            RelayedShares.from_wire(p, max_bytes=_MAX_BYTES), vectors[d.client]
        ),
        "consistency": lambda d, p: d.consistency(Survivors.from_wire(p, max_bytes=_MAX_BYTES)),
        "unmask": lambda d, p: d.unmask(Signatures.from_wire(p, max_bytes=_MAX_BYTES)),
    }
    clock = 0.0
    while True:
        step, requests = conn.recv()
        if step == "stop":
            conn.send(clock)
            return
        started = time.process_time()
        out = {c: steps[step](devices[c], p).to_wire() for c, p in requests.items()}
        clock += time.process_time() - started
        conn.send(out)


class _Fleet:
    """The worker processes and the traffic each device sent and received."""

    def __init__(self, names: list[str], settings: SecAggSettings) -> None:
        key = Ed25519PrivateKey.generate()
        ca = ca_certificate(key, name="scale CA", valid=_VALID)
        raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())  # fmt: skip
        der = ca.public_bytes(serialization.Encoding.DER)
        context = mp.get_context("fork")
        self.owner: dict[str, int] = {}
        self.pipes: list[Connection] = []
        self.processes = []
        for w in range(WORKERS):
            mine = names[w::WORKERS]
            self.owner |= dict.fromkeys(mine, w)
            here, there = context.Pipe()
            p = context.Process(target=_worker, args=(there, mine, settings, raw, der, w),
                                daemon=True)  # fmt: skip
            p.start()
            self.pipes.append(here)
            self.processes.append(p)
        self.bytes = dict.fromkeys(names, 0)
        self.steps: dict[str, float] = {}  # bytes of each stage's requests and answers

    def ask(self, step: str, requests: Mapping[str, bytes]) -> dict[str, bytes]:
        """Each device's answer to its request; counts both ways' bytes."""
        for c, p in requests.items():
            self.bytes[c] += len(p)
        self.steps[f"{step}_down"] = float(sum(map(len, requests.values())))
        for w, pipe in enumerate(self.pipes):
            pipe.send((step, {c: p for c, p in requests.items() if self.owner[c] == w}))
        answers: dict[str, bytes] = {}
        for pipe in self.pipes:
            answers |= pipe.recv()
        for c, p in answers.items():
            self.bytes[c] += len(p)
        self.steps[f"{step}_up"] = float(sum(map(len, answers.values())))
        return answers

    def stop(self) -> float:
        """The devices' CPU seconds, all workers together."""
        total = 0.0
        for pipe, p in zip(self.pipes, self.processes, strict=True):
            pipe.send(("stop", {}))
            total += pipe.recv()
            p.join(60)
        return total


def measure(name: str, devices: int, neighbours: int, colluding: int) -> dict[str, float]:
    """One round of ``devices`` (module text)."""
    release = secure_release(table(devices, neighbours, colluding), k=K, classes=CLASSES,
                             gram=True, devices=devices)  # fmt: skip
    settings = release.settings
    names = [f"dev-{i:05d}" for i in range(devices)]
    wall = time.perf_counter()
    fleet = _Fleet(names, settings)
    server = SecAggServer(fleet=FLEET, round=0, settings=settings)
    clock = 0.0

    def coordinator(take: Callable[[Any], None], kind: Any, answers: Mapping[str, bytes],
                    close: Callable[[], Mapping[str, Any]]) -> dict[str, bytes]:  # fmt: skip
        nonlocal clock
        started = time.process_time()
        for p in answers.values():
            take(kind.from_wire(p, max_bytes=_MAX_BYTES))
        out = {c: m.to_wire() for c, m in close().items()}
        clock += time.process_time() - started
        return out

    requests = dict.fromkeys(names, b"")
    fleet.bytes = dict.fromkeys(names, 0)
    for step, take, kind, close in (
        ("advertise", server.take_advertise, Advertise, server.close_advertise),
        ("share", server.take_share, ShareKeys, server.close_share),
        ("masked", server.take_masked_input, MaskedInput, server.close_masked_input),
        ("consistency", server.take_consistency, Consistency, server.close_consistency),
    ):
        requests = coordinator(take, kind, fleet.ask(step, requests), close)
        print(f"  {name}: {step} done", file=sys.stderr, flush=True)
    answers = fleet.ask("unmask", requests)
    started = time.process_time()
    for p in answers.values():
        server.take_unmask(Unmask.from_wire(p, max_bytes=_MAX_BYTES))
    result = server.close_unmask()
    clock += time.process_time() - started
    device_s = fleet.stop()
    if len(result.survivors) != devices:
        raise RuntimeError(f"{name}: {len(result.survivors)} of {devices} survived")
    traffic = np.array([fleet.bytes[c] for c in names], dtype=np.float64)
    try:
        draws = openings(devices=devices, colluding=colluding, quorum=settings.fewest)
    except ValueError:
        draws = 0
    sent = requests[names[0]]  # device 0's evidence: compact when it carries few entries
    compact = Signatures.from_wire(sent, max_bytes=_MAX_BYTES).marks != b""
    return {
        f"fleet.{name}_bytes_per_device": float(traffic.mean()),
        f"fleet.{name}_bytes_per_device_max": float(traffic.max()),
        f"fleet.{name}_seconds": clock,
        f"fleet.{name}_device_seconds": device_s / devices,
        f"fleet.{name}_wall_s": time.perf_counter() - wall,
        f"fleet.{name}_neighbours": float(neighbours or devices - 1),
        f"fleet.{name}_threshold": float(settings.threshold),
        f"fleet.{name}_quorum": float(settings.fewest),
        f"fleet.{name}_colluding": float(colluding),
        f"fleet.{name}_evidence_draws": float(draws if compact else 0),
        f"fleet.{name}_length": float(settings.length),
        # What a device sent or received at each stage, the mean: where the bytes go.
        **{f"fleet.{name}_bytes_{k}": v / devices for k, v in fleet.steps.items() if v},
    }


def run() -> dict[str, float]:
    out: dict[str, float] = {}
    for name, devices, neighbours, colluding in RUNS:
        out |= measure(name, devices, neighbours, colluding)
    return out


if __name__ == "__main__":
    chosen = [r for r in RUNS if r[0] in sys.argv[1:]] or list(RUNS)
    for run_ in chosen:
        for key, value in measure(*run_).items():
            print(f"{key} = {value:,.4g}")
