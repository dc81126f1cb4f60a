"""The ``vector`` transport for the closed-form methods (lda, ridge, fedcof): every client
of a fleet of thousands against the real round manager and store, in this process.

A closed-form device trains nothing, so there is nothing to batch: each client is the
agent's own :class:`edge_agent.closed_form.ClosedFormDevice` (the same statistics, the
same choice of head), built for its moment and let go, so a fleet's memory is one
client's features and the coordinator's running sum. Round 0 carries every client's
statistics; a client's later updates carry none (in this process an accepted update is
a stored one: the receipt an agent waits for). A client chooses its head when the
announced head changes, and keeps its score while it does not.

Under ``--secure-aggregation`` no update carries statistics: round 0 is closed with the
fleet's secure sum as its secure-aggregation round would hand it to the coordinator
(:class:`fleet.engine.secure_sum.SimulatedSecureSum`: every device's quantised, noised
statistics summed in the ring, every device surviving), which the real round manager
adds to the fleet's sum and solves. A later round, which no device joins (the sum holds
every device's statistics), is closed with an empty sum: over MQTT its first stage
would abort for want of devices, and the head announced is the same either way, without
the coordinator's warning about it every round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from random import Random
from typing import Any

import numpy as np

from coordinator.rounds.secure import SecureOutcome
from edge_agent.closed_form import ClosedFormDevice, StatisticsRelease
from edge_agent.config import ClosedFormSettings, PrivacySettings
from edge_agent.methods import device_method
from edge_agent.privacy.accounting import epsilon, gaussian_release
from edge_agent.privacy.randomness import NoiseSource, guarantee
from fleet.engine.batch import FleetFeatures
from fleet.engine.secure_sum import SimulatedSecureSum
from fleet.transports.configs import agent_seed
from fleet.transports.secure import release_of
from fleet.transports.spec import FLEET, RunSpec
from fleet.transports.vector_records import Records, drive_rounds
from protocol import PrivacyMeta, RoundAnnouncement
from runtime.cliutil import UsageError
from secagg.fleet import SecureAggregation, flatten


def _device(spec: RunSpec, data: FleetFeatures, k: int, num_classes: int) -> ClosedFormDevice:
    """Client ``k`` as an agent of the run would be (its seed, the run's [closed_form])."""
    return ClosedFormDevice(
        method=device_method(spec.method), fleet=FLEET,
        features=data.features[data.train_index[k]], labels=data.train_labels[k],
        num_classes=num_classes, settings=ClosedFormSettings(dim=spec.stats_dim, basis=spec.stats_basis),
        seed=agent_seed(spec, k), state_dir=None,
    )  # fmt: skip


def _updates(spec: RunSpec, data: FleetFeatures, *, names: list[str], num_classes: int,
             round_: int, dim: int, bundle_id: str,
             privacy: PrivacyMeta) -> Iterator[tuple[int, bytes]]:  # fmt: skip
    """Every client's update of ``round_``, as an agent sends it (edge_agent/agent.py): its
    statistics in round 0 (noisy under dp-features, from its own secret randomness as an
    agent's NoiseSource), no rows after (accepted in this process means stored)."""
    noise_multiplier = float(spec.privacy.get("release_noise_multiplier", 0.0))
    for k, client in enumerate(names):
        if round_ == 0:
            device = _device(spec, data, k, num_classes)
            if privacy.epsilon is None:
                release = device.release()
            else:
                noise = NoiseSource.create(agent_seed(spec, k) if spec.reproducible_noise else None)
                release = device.noisy_release(noise_multiplier, noise.numpy)
        else:
            release = StatisticsRelease.nothing(dim)
        update = release.update(fleet=FLEET, round_=round_, client=client, bundle=bundle_id,
                                method=spec.method, privacy=privacy)  # fmt: skip
        yield k, update.to_wire()


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
    secure: SecureAggregation | None = None,
    observe: Callable[[RoundAnnouncement], None] | None = None,
) -> Records:
    """``spec.rounds`` rounds of ``data``'s clients; their scores and traffic per round.
    ``secure``: the fleet's [secure_aggregation] table (``coord`` runs it too), whose sum
    the clients' statistics reach the coordinator in; ``observe``: as
    :func:`fleet.transports.vector_records.drive_rounds` takes it."""
    records = Records(len(names), spec.rounds)
    # A secure fleet's devices release nothing of their own (their mechanism is none).
    privacy = PrivacyMeta() if secure is not None else _privacy(spec)
    dim = int(coord["model"]["dim"])
    chosen_from: list[bytes] = []  # the head the clients last chose from
    scores = np.full(len(names), np.nan)

    def adopt(announcement: RoundAnnouncement) -> None:
        round_ = announcement.round
        head = announcement.global_prototypes.tobytes() + bytes(announcement.global_classes)
        if evaluate and round_ >= 1 and announcement.global_classes and head not in chosen_from:
            chosen_from[:] = [head]
            for k in range(len(names)):
                device = _device(spec, data, k, num_classes)
                device.adopt(announcement)
                predicted = device.scores(data.features[data.test_index[k]]).argmax(axis=1)
                scores[k] = float((predicted == data.test_labels[k]).mean())
        if round_ >= 1:
            for k in range(len(names)):
                value = None if np.isnan(scores[k]) else float(scores[k])
                records.set(k, round_ - 1, {"test_accuracy": value,
                                            "test_accuracy_classifier": value})  # fmt: skip

    def updates(announcement: RoundAnnouncement) -> Iterator[tuple[int, bytes]]:
        return _updates(spec, data, names=names, num_classes=num_classes,
                        round_=announcement.round, dim=dim, bundle_id=bundle_id,
                        privacy=privacy)  # fmt: skip

    secure_round = None
    if secure is not None:
        secure_round = _secure_rounds(spec, data, secure, names=names, num_classes=num_classes,
                                      dim=dim, records=records)  # fmt: skip
    drive_rounds(spec=spec, coord=coord, names=names, records=records, adopt=adopt,
                 updates=updates, secure_round=secure_round, observe=observe)  # fmt: skip
    return records


def _secure_rounds(spec: RunSpec, data: FleetFeatures, table: SecureAggregation, *,
                   names: list[str], num_classes: int, dim: int,
                   records: Records) -> Callable[[RoundAnnouncement], SecureOutcome]:  # fmt: skip
    """The outcome of each round's secure aggregation, as the coordinator's secure round
    hands it to the round manager (coordinator/rounds/secure_rounds.py)."""
    release = release_of(table, spec, k=dim, classes=num_classes)
    settings = release.settings
    share = None if release.plan is None else release.plan.share_sigma2
    masked_bytes = settings.length * settings.spec.bits // 8  # what each device's input is

    def outcome(announcement: RoundAnnouncement) -> SecureOutcome:
        round_ = announcement.round
        if round_ > 0:
            return SecureOutcome(round=round_, total=np.zeros(settings.length), survivors=0)
        total = SimulatedSecureSum(spec=settings.spec, share_sigma2=share)
        for k in range(len(names)):
            device = _device(spec, data, k, num_classes)
            coins, noise = noise_sources(spec, k)
            total.add(flatten(device.statistics(), gram=release.gram), coins=coins, noise=noise)
            records.bytes_up[k, round_] = masked_bytes
        return SecureOutcome(round=round_, total=total.decoded(), survivors=total.devices)

    return outcome


def noise_sources(spec: RunSpec, k: int) -> tuple[Random | None, np.random.Generator]:
    """Client ``k``'s rounding coins and noise generator: secret, as on a device (the coins
    from the operating system, the noise from an agent's NoiseSource), or replayed from
    its seed when the run asks for reproducible noise."""
    seed = agent_seed(spec, k) if spec.reproducible_noise else None
    return (None if seed is None else Random(seed)), NoiseSource.create(seed).numpy
