"""A simulated fleet's secure aggregation (``--secure-aggregation``): what a run that
cannot sum securely is refused with, the public ``[secure_aggregation]`` table a run
derives from its own public facts, and what turns it on in the coordinator's and every
agent's configuration.

Every setting is fixed by a rule on what the run makes public (its size, the partition's
training-split sizes, the budget it asks for), never tuned on results:

- ``threshold`` ``t = max(2, n - n // 10)`` (``ceil(0.9 n)``): a tenth of the fleet may
  drop out of a round.
- ``colluding`` ``c = t // 10``: a tenth of the threshold may hand its noise to the
  coordinator (the plan counts only ``t - c`` honest shares), as bench/secagg_bench.py
  fixes it at 1,000 devices.
- ``neighbours`` 0, the complete graph, at every fleet size. One threshold ``t`` is both
  the fewest survivors and the shares that rebuild a secret, so a dropped device's masking
  key needs ``t`` shares from its surviving neighbours: tolerating the ``n - t`` drops
  ``t`` allows needs degree ``n - 1``. A sparse SecAgg+ graph of logarithmic degree would
  need a threshold per neighbourhood (Bell et al., CCS 2020), which secagg/ does
  not have; a degree between the ``t - 1`` ``SecAggSettings`` admits and ``n - 1`` saves
  at most a tenth of the pairs and gives up dropouts the threshold promises to survive.
- ``dataset_size``: the largest client's training split (or a larger declared
  ``privacy.dataset_size``). Public here: a simulated partition's split sizes are its
  settings (``--train``), as a deployment declares its bound (docs/privacy.md). It is the
  statistics' clip; FedProto's prototype rows are clipped at 1 whatever it is.
- ``epsilon``, ``delta``: the run's formal release (``spec.privacy``) moved into the sum;
  0, no noise, when it asks for none (:func:`sum_budget`; FedProto's sum takes none).
- ``bits``: 32 when that ring holds the fleet's sum with ten standard deviations of the
  noise to spare (``check_ring``), else 64; ``scale`` the runtime's default, 2^15.
- ``stage_timeout_s``: four times the slowest stage's estimated work (:func:`stage_timeout`),
  at least :data:`MIN_STAGE_S`. Over MQTT every stage closes once each device it waits
  for has answered, so the deadline only bounds a failure, and a round nobody joins (a
  closed-form fleet's rounds after the first: the sum holds every device's statistics)
  waits it out.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol

from coordinator.config import CoordinatorConfig, ModelSettings, WorkersSettings
from coordinator.strategies import RobustOptions
from coordinator.strategies.base import RAW
from edge_agent.privacy.settings import PrivacySettings
from protocol.methods import wire_method
from runtime.cliutil import UsageError
from runtime.security import CoordinatorSecurity
from secagg.fleet import (
    SecureAggregation,
    SecureRelease,
    ledger_multiplier,
    prototype_release,
    secure_release,
)
from secagg.plan import check_ring


class RunSpec(Protocol):
    """What this module reads of a run (fleet/transports/spec.py::RunSpec, which checks
    itself with :func:`secure_refusal`: named here, not imported, so the two modules do
    not import each other)."""

    @property
    def method(self) -> str: ...
    @property
    def rounds(self) -> int: ...
    @property
    def transport(self) -> str: ...
    @property
    def workers(self) -> int: ...
    @property
    def coordinator_workers(self) -> int | None: ...
    @property
    def epochs(self) -> int: ...
    @property
    def privacy(self) -> dict[str, Any]: ...
    @property
    def reproducible_noise(self) -> bool: ...


#: One in this many devices may drop out of a round, and one in this many of the threshold
#: may collude with the coordinator.
DROPOUT_EVERY = 10
COLLUDING_EVERY = 10

#: The shortest stage deadline: long enough for a worker process to hand a few agents'
#: first stage to the broker on a loaded machine.
MIN_STAGE_S = 20.0
#: What the deadline's estimate assumes a core does per second, about half of what the
#: development machine (AMD EPYC, 2 cores) measures: the exact discrete Gaussian sampler's
#: draws at a fleet's share sizes (secagg/noise.py, 36,000), mask words
#: (keystream, 60 million) and backbone rows (the agent computes its features when round
#: 0 asks for its statistics).
NOISE_DRAWS_PER_S = 15_000.0
MASK_WORDS_PER_S = 20e6
FEATURE_ROWS_PER_S = 200.0
#: Training rows a core takes a prototype method's head through per second, a local epoch
#: being what a device does before it joins each round; about half the development
#: machine's.
TRAIN_ROWS_PER_S = 500.0

#: The most rounds a secure closed-form fleet runs over MQTT. Its head is solved from
#: round 0's sum; every later round finds no device with statistics the sum does not hold,
#: and its first stage waits out the stage deadline before it aborts. (A prototype method's
#: devices join every round.)
MAX_SECURE_MQTT_ROUNDS = 2


def sum_budget(spec: RunSpec) -> tuple[float, float]:
    """(epsilon, delta) the secure sum's noise spends: the run's formal release's, or
    epsilon 0 (no noise) when it asks for none."""
    privacy = spec.privacy
    delta = float(privacy.get("delta", PrivacySettings.delta))
    if privacy.get("mechanism", "none") == "none":
        return 0.0, delta
    return float(privacy.get("epsilon", PrivacySettings.epsilon)), delta


def secure_refusal(spec: RunSpec) -> str | None:
    """Why ``spec`` cannot run with ``--secure-aggregation``, in one line; None if it can.
    A method the coordinator refuses is refused in its words."""
    mechanism = spec.privacy.get("mechanism", "none")
    if mechanism not in ("none", "dp-features"):
        return (
            "--secure-aggregation moves a dp-features release into the fleet's sum; "
            f"privacy.mechanism {mechanism!r} has no secure form"
        )
    epsilon, delta = sum_budget(spec)
    try:
        table = SecureAggregation(threshold=2, dataset_size=1, epsilon=epsilon, delta=delta)
    except ValueError as exc:
        return f"--secure-aggregation: {exc}"
    # Placeholders for what the run fills in later (the model's sizes, the fleet's table,
    # the defences a secure fleet of rows would have to leave off): the refusal reads the
    # method, [workers] and the noise asked.
    try:
        closed_form = wire_method(spec.method).closed_form
        coordinator = CoordinatorConfig(
            fleet="placeholder", state_dir=Path("unused"),
            model=ModelSettings(method=spec.method, feature_dim=1),
            workers=WorkersSettings(count=spec.coordinator_workers or 0),
            secure_aggregation=table, robust=RobustOptions() if closed_form else RAW,
            security=CoordinatorSecurity(insecure=True),
        )  # fmt: skip
    except ValueError as exc:  # not a fleet's method (the comparison's ceiling, central)
        return f"--secure-aggregation: {exc}"
    problem = coordinator.secure_problem()
    if problem is not None:
        return f"--secure-aggregation: {problem}"
    if spec.transport == "memory":
        return (
            "--secure-aggregation runs over --transport mqtt (the protocol itself) or vector "
            "(its sum simulated): the memory transport has no MQTT for the protocol's stages"
        )
    if spec.transport == "vector" and not closed_form:
        return (
            "--secure-aggregation: the vector transport simulates the secure sum of "
            f"closed-form statistics (lda, ridge); {spec.method}'s runs over --transport mqtt"
        )
    if spec.transport == "mqtt":
        if closed_form and spec.rounds > MAX_SECURE_MQTT_ROUNDS:
            return (
                f"--secure-aggregation over mqtt: the head is solved from round 0's sum, and "
                "each later round waits out a stage deadline for devices with nothing new to "
                f"sum: give --rounds 1 or {MAX_SECURE_MQTT_ROUNDS} (or --transport vector)"
            )
        if spec.reproducible_noise:
            return (
                "--secure-aggregation over mqtt: each device draws its share of the sum's "
                "noise from its own secret source; reproducible noise is for --transport vector"
            )
    return None


def threshold_for(clients: int) -> int:
    """``t = max(2, ceil(0.9 n))``, in integers: the fewest devices a round may finish
    with."""
    return max(2, clients - clients // DROPOUT_EVERY)


def stage_timeout(
    *, clients: int, length: int, largest: int, noise: bool, workers: int, epochs: int = 0
) -> float:
    """Seconds each stage stays open: four times the estimated wall time of the slowest,
    the masked input, in which each device computes its features (first stage, at worst),
    trains ``epochs`` local epochs (a prototype method, before it joins), samples its noise
    share (``length`` exact draws) and expands a mask per neighbour. The devices of one
    worker process take turns (the sampler is pure Python), and the worker processes share
    the machine's cores."""
    cores = max(1, min(workers, os.cpu_count() or 1))
    per_device = largest / FEATURE_ROWS_PER_S + clients * length / MASK_WORDS_PER_S
    per_device += epochs * largest / TRAIN_ROWS_PER_S
    if noise:
        per_device += length / NOISE_DRAWS_PER_S
    return max(MIN_STAGE_S, round(4 * math.ceil(clients / cores) * per_device, 1))


def public_settings(
    spec: RunSpec, *, clients: int, largest: int, k: int, classes: int
) -> SecureAggregation:
    """The ``[secure_aggregation]`` table of ``spec``'s fleet of ``clients`` devices whose
    largest training split is ``largest``, for releases of ``k`` features (the statistics'
    projection, or the prototypes' size) over ``classes``; refused (UsageError) when no
    ring holds its sum."""
    if clients < 2:
        raise UsageError(f"--secure-aggregation needs at least 2 clients, not {clients}")
    epsilon, delta = sum_budget(spec)
    threshold = threshold_for(clients)
    declared = int(spec.privacy.get("dataset_size") or 0)
    table = SecureAggregation(
        threshold=threshold,
        neighbours=0,
        colluding=threshold // COLLUDING_EVERY,
        epsilon=epsilon,
        delta=delta,
        dataset_size=max(largest, declared),
    )
    record = wire_method(spec.method)
    problem = ""
    for bits in (32, 64):
        candidate = replace(table, bits=bits)
        try:
            release = _release(candidate, spec, k=k, classes=classes, clients=clients)
        except ValueError as exc:
            problem = str(exc)
            continue
        timeout = stage_timeout(
            clients=clients, length=release.settings.length, largest=largest,
            noise=release.plan is not None, workers=spec.workers,
            epochs=0 if record.closed_form else spec.epochs,
        )  # fmt: skip
        return replace(candidate, stage_timeout_s=timeout)
    raise UsageError(f"--secure-aggregation: {problem}")


def release_of(table: SecureAggregation, spec: RunSpec, *, k: int, classes: int) -> SecureRelease:
    """What the coordinator and every device run each round with under ``table``: the
    statistics' release of a closed-form method, the prototype rows' of another."""
    record = wire_method(spec.method)
    if record.closed_form:
        return secure_release(table, k=k, classes=classes, gram=record.gram)
    return prototype_release(table, dim=k, classes=classes)


def _release(
    table: SecureAggregation, spec: RunSpec, *, k: int, classes: int, clients: int
) -> SecureRelease:
    """The release every party builds from ``table``, checked as they check it: the ring
    holds the sum of ``clients`` devices (noise included) and a device's ledger can price
    the noise."""
    release = release_of(table, spec, k=k, classes=classes)
    if release.plan is not None:
        check_ring(release.plan, spec=release.settings.spec, devices=clients)
    if not release.settings.fits(clients):
        raise ValueError(
            f"a {table.bits}-bit ring does not hold the sum of {clients} devices of up to "
            f"{table.dataset_size} samples at scale {table.scale:g}"
        )
    if release.plan is not None:
        ledger_multiplier(release.plan)
    return release


def coordinator_tables(table: SecureAggregation, *, method: str) -> dict[str, Any]:
    """The coordinator's [privacy] and [secure_aggregation] tables, and for a prototype
    method the [robust] table without the median defences, which need each device's rows
    (a closed-form coordinator takes no [robust] table at all)."""
    tables: dict[str, Any] = {
        "privacy": {"aggregation": "secure"},
        "secure_aggregation": asdict(table),
    }
    if not wire_method(method).closed_form:
        tables["robust"] = {"median_count_cap": False, "median_norm_clip": False,
                            "median_direction_screen": False}  # fmt: skip
    return tables


def agent_tables(table: SecureAggregation) -> dict[str, Any]:
    """An agent's [privacy] and [secure_aggregation] tables. Its own mechanism is none
    (the sum's noise replaces it); with noise, the run's epsilon is also its [privacy]
    cap, which the one round that sums its statistics spends within (the ledger prices
    the sum's Gaussian no higher than the plan's epsilon: docs/privacy.md)."""
    privacy: dict[str, Any] = {"aggregation": "secure", "mechanism": "none", "delta": table.delta}
    if table.epsilon > 0:
        privacy["epsilon"] = table.epsilon
    return {"privacy": privacy, "secure_aggregation": asdict(table)}
