"""The ``vector`` transport for the closed-form methods (lda, ridge, fedcof): every client
of a fleet of thousands against the real round manager and store, in this process.

A closed-form device trains nothing, so there is nothing to batch: each client is the
agent's own :class:`edge_agent.closed_form.ClosedFormDevice` (the same statistics, the
same choice of head), built for its moment and let go, so a fleet's memory is one
client's features and the coordinator's running sum. Round 0 carries every client's
statistics; a client's later updates carry none (in this process an accepted update is
a stored one: the receipt an agent waits for). A client chooses its head when the
announced head changes, and keeps its score while it does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coordinator.config import CoordinatorConfig
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.store import Store
from edge_agent.closed_form import ClosedFormDevice, StatisticsRelease
from edge_agent.config import ClosedFormSettings, PrivacySettings
from edge_agent.methods import device_method
from edge_agent.privacy.accounting import epsilon, gaussian_release
from edge_agent.privacy.randomness import NoiseSource, guarantee
from fleet.configs import agent_seed
from fleet.progress import log_round, progress_bar
from fleet.spec import FLEET, RunSpec
from fleet.vector_engine import FleetFeatures
from fleet.vector_records import OFFER_BATCH, Records, offer
from protocol import DEFAULT_MAX_PAYLOAD_BYTES, PrivacyMeta, RoundAnnouncement
from runtime.cliutil import UsageError
from runtime.faults import crash_point
from runtime.settings import build


def _device(spec: RunSpec, data: FleetFeatures, k: int, num_classes: int) -> ClosedFormDevice:
    """Client ``k`` as an agent of the run would be (its seed, the run's [closed_form])."""
    return ClosedFormDevice(
        method=device_method(spec.method), fleet=FLEET,
        features=data.features[data.train_index[k]], labels=data.train_labels[k],
        num_classes=num_classes, settings=ClosedFormSettings(dim=spec.stats_dim),
        seed=agent_seed(spec, k), state_dir=None,
    )  # fmt: skip


def _privacy(spec: RunSpec) -> PrivacyMeta:
    """What every client's updates say of their privacy: none, or a dp-features release
    of ``release_noise_multiplier``, with the epsilon one such release spends."""
    settings = dict(spec.privacy)
    mechanism = settings.get("mechanism", "none")
    if mechanism == "none":
        return PrivacyMeta()
    if mechanism not in device_method(spec.method).modes or mechanism != "dp-features":
        raise UsageError(f"the vector transport runs {spec.method} with no privacy "
                         f"mechanism or dp-features, not {mechanism}")  # fmt: skip
    z = float(settings["release_noise_multiplier"])
    delta = float(settings.get("delta", PrivacySettings.delta))
    spent = epsilon([gaussian_release(z)], delta=delta)
    return PrivacyMeta(mechanism=mechanism, epsilon=spent, delta=delta,
                       guarantee=guarantee(formal=True, reproducible=spec.reproducible_noise))  # fmt: skip


def drive_closed_form(
    *,
    spec: RunSpec,
    data: FleetFeatures,
    names: list[str],
    coord: dict[str, Any],
    bundle_id: str,
    num_classes: int,
    evaluate: bool = True,
) -> Records:
    """``spec.rounds`` rounds of ``data``'s clients; their scores and traffic per round."""
    cfg = build(CoordinatorConfig, coord)
    records = Records(len(names), spec.rounds)
    privacy = _privacy(spec)
    noise_multiplier = float(spec.privacy.get("release_noise_multiplier", 0.0))
    method = spec.method
    dim = int(coord["model"]["dim"])
    store = Store(cfg.database, synchronous=cfg.sqlite_synchronous, keep_payloads=False)
    previous: bytes | None = None  # the head the clients last chose from
    scores = np.full(len(names), np.nan)
    try:
        manager = RoundManager(config=cfg, store=store, metrics=Metrics())
        with progress_bar(spec, spec.rounds * len(names), f"{method}: client-rounds",
                          "client") as bar:  # fmt: skip
            while True:
                wire = manager.announcement.to_wire()
                announcement = RoundAnnouncement.from_wire(
                    wire, max_bytes=DEFAULT_MAX_PAYLOAD_BYTES
                )
                round_ = announcement.round
                head = announcement.global_prototypes.tobytes() + bytes(announcement.global_classes)
                if (
                    evaluate
                    and round_ >= 1
                    and len(announcement.global_classes)
                    and head != previous
                ):
                    previous = head
                    for k in range(len(names)):
                        device = _device(spec, data, k, num_classes)
                        device.adopt(announcement)
                        test = data.features[data.test_index[k]]
                        predicted = device.scores(test).argmax(axis=1)
                        scores[k] = float((predicted == data.test_labels[k]).mean())
                if round_ >= 1:
                    for k in range(len(names)):
                        value = None if np.isnan(scores[k]) else float(scores[k])
                        records.set(k, round_ - 1, {"test_accuracy": value,
                                                    "test_accuracy_classifier": value})  # fmt: skip
                if manager.done:
                    break
                pending: list[tuple[int, bytes]] = []
                for k, client in enumerate(names):
                    # What an agent without a privacy mechanism sends (edge_agent/agent.py).
                    if round_ == 0:
                        device = _device(spec, data, k, num_classes)
                        # Each device's own secret randomness, as an agent's NoiseSource.
                        noise = None if privacy.epsilon is None else NoiseSource.create(
                            agent_seed(spec, k) if spec.reproducible_noise else None
                        )  # fmt: skip
                        release = (
                            device.release()
                            if noise is None
                            else device.noisy_release(noise_multiplier, noise.numpy)
                        )
                    else:
                        release = StatisticsRelease.nothing(dim)
                    update = release.update(fleet=FLEET, round_=round_, client=client,
                                            bundle=bundle_id, method=method,
                                            privacy=privacy)  # fmt: skip
                    pending.append((k, update.to_wire()))
                    records.bytes_down[k, round_] = len(wire)
                    if len(pending) == OFFER_BATCH:
                        offer(manager, store, pending, names, records, round_)
                        bar.update(len(pending))
                        pending = []
                offer(manager, store, pending, names, records, round_)
                bar.update(len(pending))
                if manager.poll() is None:
                    raise RuntimeError(f"round {round_} did not close")
                log_round(spec, round_ + 1)
                crash_point(f"fleet:{method}:round_closed")
    finally:
        store.close()
    return records
