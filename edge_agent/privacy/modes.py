"""How a device answers a round under its privacy mechanism: one mode object per agent,
chosen once from ``[privacy] mechanism`` by :data:`MODES`. Like Flower's client mods, a
mode wraps the round in three steps: ``admit`` (may this round be answered: the budget),
``train`` (the round's local training) and ``release`` (what leaves the device).

- ``none``, ``paper`` (:class:`PlainMode`): every round is answered; the head trains by
  the method's objective; the mechanism releases the prototypes of its embeddings.
- ``dp`` (:class:`DpMode`): a round is answered while the ledger allows its DP-SGD steps
  and its release, both priced from public settings before training; the head trains by
  DP-SGD; the release is written to the ledger before it exists anywhere else.
- ``dp-features`` (:class:`FeatureMode`): the data version's one Gaussian release of the
  frozen features, made and paid for once when a round is admitted and sent again every
  round; the head trains without noise by the anchored learner (``edge_agent/anchored.py``),
  which also chooses the model and the rule the device predicts with.

A closed-form method trains nothing: its device asks its mode only for the release of its
statistics (:meth:`PrivacyMode.release_statistics`) and the metadata that goes with it.
What each mechanism is (its release function, space, claim) is its record in
``edge_agent/privacy/mechanisms.py::MECHANISMS``, which the configuration's checks read
without importing torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edge_agent.anchored import AnchoredLearner
from edge_agent.closed_form import ClosedFormDevice, StatisticsRelease
from edge_agent.fit_split import FitSplit
from edge_agent.methods import device_method
from edge_agent.privacy.accounting import gaussian_release
from edge_agent.privacy.dpsgd import train_round_dp
from edge_agent.privacy.ledger import Ledger
from edge_agent.privacy.mechanisms import Release
from edge_agent.privacy.randomness import NONE, NoiseSource
from edge_agent.privacy.settings import PrivacySettings
from edge_agent.privacy.spending import Spending
from edge_agent.state import StateDir
from edge_agent.train import Guidance, LocalModel, RoundMetrics, train_round
from edge_agent.train_config import TrainConfig
from protocol import PrivacyMeta, RoundAnnouncement
from runtime.faults import crash_point
from secagg.fleet import ledger_multiplier
from secagg.plan import DistributedPlan

#: What leaves the device, and the epsilon spent so far (None without a formal claim).
Released = tuple[Release, float | None]


@dataclass(frozen=True, kw_only=True)
class LocalTraining:
    """What a device trains every round: its head and optimiser, its cached features
    (N, K*d_e) and labels (N,), and the data order (public randomness, the run's seed)."""

    model: LocalModel
    optimiser: torch.optim.Optimizer
    features: np.ndarray
    labels: np.ndarray
    num_classes: int
    generator: torch.Generator
    method: str
    client: str
    cfg: TrainConfig
    seed: int

    def guidance(self, announcement: RoundAnnouncement) -> Guidance:
        """What the announcement brings to the objective, at the head's embedding size."""
        return Guidance.from_announcement(announcement, client=self.client, dim=self.cfg.out_dim)


@dataclass(frozen=True)
class Trained:
    """A round's training: its metrics, and what the round's record keeps beside them."""

    metrics: RoundMetrics
    record: dict[str, Any] = field(default_factory=dict)


class PrivacyMode(ABC):
    """A device's privacy mechanism at work: its ledger (read, and refused if it was kept
    with another delta or accountant), its secret randomness and its spending plan."""

    def __init__(
        self,
        *,
        settings: PrivacySettings,
        local: LocalTraining,
        state: StateDir,
        data_version: str,
    ) -> None:
        self.settings = settings
        self.local = local
        self.state = state
        self.data_version = data_version  # what a once-per-data-version release is of
        self.ledger = Ledger(state.root, epsilon_budget=settings.epsilon, delta=settings.delta,
                             accountant=settings.accountant)  # fmt: skip
        # Secret unless the configuration asks for replayable noise (experiments only).
        self.noise = NoiseSource.create(settings.reproducible_noise_seed)
        self.spending = Spending(settings=settings, train=local.cfg, ledger=self.ledger,
                                 noise=self.noise)  # fmt: skip

    @abstractmethod
    def admit(self, round_: int) -> bool:
        """Whether round ``round_`` may be answered within the budget (asked before
        training: a refused round trains nothing and spends nothing)."""

    @abstractmethod
    def train(self, announcement: RoundAnnouncement) -> Trained:
        """The round's local training of the device's head."""

    @abstractmethod
    def release(self, round_: int, z: np.ndarray, labels: np.ndarray) -> Released:
        """What leaves the device for the round whose embeddings are ``z`` (N, d), and
        the epsilon spent so far (None without a formal claim)."""

    @abstractmethod
    def release_statistics(
        self, round_: int, *, version: str, closed: ClosedFormDevice
    ) -> tuple[StatisticsRelease, float | None] | None:
        """A closed-form device's statistics as they leave it, and the epsilon spent;
        None if the budget refuses them. ``version``: what they are of."""

    def admit_secure_sum(self, round_: int, plan: DistributedPlan | None) -> bool:
        """Whether the budget allows a secure fleet's round (edge_agent/secure_delivery.py):
        the sum's noise, priced as the sum's epsilon for one round
        (:func:`secagg.fleet.ledger_multiplier`). Nothing is recorded yet: a round is paid
        for when the device's noised input leaves it (:meth:`charge_secure_sum`), so one
        that aborts before costs nothing. ``plan`` None: no noise, no claim."""
        if plan is None:
            return True
        return self.ledger.allows([gaussian_release(ledger_multiplier(plan))])

    def charge_secure_sum(self, round_: int, plan: DistributedPlan | None) -> bool:
        """Record round ``round_``'s secure sum in the ledger, durably, just before the
        device's masked input (its noised input) leaves it: on the protocol's thread, not
        the service's (the ledger locks). False, and nothing recorded, when the budget no
        longer allows it (another release was paid for since it was admitted)."""
        if plan is None:
            return True
        event = gaussian_release(ledger_multiplier(plan))
        with self.ledger.lock:
            if not self.ledger.allows([event]):
                return False
            self.ledger.record(round_, [event])
        return True

    @abstractmethod
    def spent(self) -> float | None:
        """The epsilon spent so far (None without a formal claim)."""

    @abstractmethod
    def meta(self, spent: float | None) -> PrivacyMeta:
        """The privacy metadata of an update released with ``spent`` epsilon spent."""

    @abstractmethod
    def wire_counts(self, counts: Iterable[Any]) -> tuple[float, ...] | tuple[int, ...]:
        """A release's counts as the update carries them."""

    @property
    def predictor(self) -> LocalModel:
        """The model the device predicts with (and whose embeddings a round releases)."""
        return self.local.model

    @property
    def predict_rule(self) -> str | None:
        """The rule (a key of ``edge_agent.inference.RULES``) the device predicts by when
        it is not its method's own; None: the method's."""
        return None

    @classmethod
    def stored_rule(cls, history: Sequence[dict[str, Any]]) -> str | None:
        """:attr:`predict_rule` as the state folder's round ``history`` keeps it, for
        ``edge-agent predict``; None: the method's own rule."""
        return None

    def prototype_dim(self, *, feature_dim: int) -> int:
        """The size of the fleet's prototypes: the head's embeddings."""
        return self.local.cfg.out_dim

    def save(self) -> None:
        """Keep what the mode holds beyond a round's state (before the round commits)."""
        return  # none and paper, dp: nothing beyond the round's state

    def _mechanism_release(self, z: np.ndarray, labels: np.ndarray) -> Release:
        return self.settings.spec.release(z, labels, self.local.num_classes,
                                          self.spending.mechanism_params(), self.noise.numpy)  # fmt: skip


class PlainMode(PrivacyMode):
    """``none`` and ``paper``: no budget; the mechanism's release of the embeddings."""

    def admit(self, round_: int) -> bool:
        return True

    def train(self, announcement: RoundAnnouncement) -> Trained:
        local = self.local
        return Trained(
            train_round(local.model, local.optimiser, local.features, local.labels,
                        method=local.method, guidance=local.guidance(announcement),
                        cfg=local.cfg, generator=local.generator)
        )  # fmt: skip

    def release(self, round_: int, z: np.ndarray, labels: np.ndarray) -> Released:
        return self._mechanism_release(z, labels), None

    def release_statistics(
        self, round_: int, *, version: str, closed: ClosedFormDevice
    ) -> tuple[StatisticsRelease, float | None] | None:
        return closed.release(), None

    def spent(self) -> float | None:
        return None

    def meta(self, spent: float | None) -> PrivacyMeta:
        return PrivacyMeta(mechanism=self.settings.mechanism, epsilon=spent, delta=None,
                           guarantee=NONE)  # fmt: skip

    def wire_counts(self, counts: Iterable[Any]) -> tuple[int, ...]:
        return tuple(int(c) for c in counts)


class _Accounted(PrivacyMode):
    """The formal mechanisms: an (epsilon, delta) claim whose every spend the ledger
    holds before what it pays for leaves the device."""

    def spent(self) -> float | None:
        return self.ledger.spent()

    def meta(self, spent: float | None) -> PrivacyMeta:
        return PrivacyMeta(mechanism=self.settings.mechanism, epsilon=spent,
                           delta=self.settings.delta, guarantee=self.ledger.guarantee)  # fmt: skip

    def wire_counts(self, counts: Iterable[Any]) -> tuple[float, ...]:
        # Noisy counts as 64-bit floats: an update's size must not depend on them.
        return tuple(float(c) for c in counts)

    def release_statistics(
        self, round_: int, *, version: str, closed: ClosedFormDevice
    ) -> tuple[StatisticsRelease, float | None] | None:
        made = self.spending.statistics_release(
            round_, state=self.state, data_version=version,
            make=lambda z, rng: closed.noisy_release(z, rng).arrays(),
        )  # fmt: skip
        if made is None:
            return None
        return StatisticsRelease.from_arrays(made[0]), made[1]


class DpMode(_Accounted):
    """``dp``: DP-SGD, then a Gaussian release of the embeddings' prototypes, every round."""

    def admit(self, round_: int) -> bool:
        # Checked before training: the round's DP-SGD steps are paid for by its release.
        return self.ledger.allows(self.spending.dp_events())

    def train(self, announcement: RoundAnnouncement) -> Trained:
        local, p = self.local, self.settings
        return Trained(
            train_round_dp(local.model, local.optimiser, local.features, local.labels,
                           method=local.method, guidance=local.guidance(announcement),
                           cfg=local.cfg, schedule=self.spending.schedule(),
                           noise=self.noise.torch, noise_multiplier=p.sgd_noise_multiplier,
                           max_grad_norm=p.max_grad_norm)
        )  # fmt: skip

    def release(self, round_: int, z: np.ndarray, labels: np.ndarray) -> Released:
        release = self._mechanism_release(z, labels)
        # Durable before the update exists anywhere: a crash from here on can only
        # over-count this release, never forget it.
        spent = self.ledger.record(
            round_, self.spending.dp_events(), reproducible=self.noise.reproducible
        )
        crash_point("after_ledger_write")
        return release, spent


class FeatureMode(_Accounted):
    """``dp-features``: one release of the frozen features per data version; the head
    trains without noise (the anchored learner) and never leaves the device."""

    def __init__(
        self,
        *,
        settings: PrivacySettings,
        local: LocalTraining,
        state: StateDir,
        data_version: str,
    ) -> None:
        super().__init__(settings=settings, local=local, state=state, data_version=data_version)
        self._admitted: tuple[int, Release, float] | None = None
        # A closed-form method trains no head: it releases its statistics alone.
        self.learner: AnchoredLearner | None = None
        if device_method(local.method).trains_head:
            split = FitSplit.stratified(local.labels, share=settings.validation_share,
                                        seed=local.seed)  # fmt: skip
            self.learner = AnchoredLearner(
                model=local.model, method=local.method, weights=settings.anchor_weights,
                cfg=local.cfg, features=local.features, labels=local.labels, split=split,
                seed=local.seed, state_dir=state.root,
            )  # fmt: skip

    def admit(self, round_: int) -> bool:
        """Made (and paid for) here, before training, if the data version has none yet."""
        local = self.local
        made = self.spending.feature_release(
            round_, state=self.state, data_version=self.data_version, features=local.features,
            labels=local.labels, num_classes=local.num_classes,
        )  # fmt: skip
        self._admitted = None if made is None else (round_, *made)
        return made is not None

    def train(self, announcement: RoundAnnouncement) -> Trained:
        local, learner = self.local, self._learner()
        metrics, choice = learner.train_round(
            local.features, local.labels, announcement, client=local.client,
            generator=local.generator, optimiser=local.optimiser,
        )  # fmt: skip
        return Trained(metrics, {
            "anchor_weight": choice.weight,
            "predict_rule": choice.rule,
            "val_accuracies": [list(v) for v in choice.val_accuracies],
        })  # fmt: skip

    def release(self, round_: int, z: np.ndarray, labels: np.ndarray) -> Released:
        """The data version's release made when the round was admitted, sent again every
        round as post-processing; ``z`` stays on the device."""
        if self._admitted is None or self._admitted[0] != round_:
            raise RuntimeError(f"round {round_} was not admitted")
        _, release, spent = self._admitted
        return release, spent

    @property
    def predictor(self) -> LocalModel:
        """The model the device's validation split chose."""
        return self.local.model if self.learner is None else self.learner.model

    @property
    def predict_rule(self) -> str | None:
        return None if self.learner is None else self.learner.predict_rule

    @classmethod
    def stored_rule(cls, history: Sequence[dict[str, Any]]) -> str | None:
        # The rule the device's own validation split chose last (edge_agent.anchored),
        # for the model it chose (the head checkpoint): what its rounds were scored by.
        return next((h["predict_rule"] for h in reversed(history) if "predict_rule" in h),
                    "classifier")  # fmt: skip

    def prototype_dim(self, *, feature_dim: int) -> int:
        """The size of the fleet's prototypes: the backbone features the releases are of."""
        return feature_dim

    def save(self) -> None:
        if self.learner is not None:
            self.learner.save()

    def _learner(self) -> AnchoredLearner:
        if self.learner is None:
            raise RuntimeError(f"{self.local.method} trains no head")
        return self.learner


#: The mode of each ``[privacy] mechanism``: every key of ``MECHANISMS`` has one.
MODES: dict[str, type[PrivacyMode]] = {
    "none": PlainMode,
    "paper": PlainMode,
    "dp": DpMode,
    "dp-features": FeatureMode,
}


def mode_class(mechanism: str) -> type[PrivacyMode]:
    """The mode class of ``mechanism``; a ValueError names the known ones."""
    try:
        return MODES[mechanism]
    except KeyError:
        raise ValueError(
            f"no privacy mode for mechanism {mechanism!r}; use one of {', '.join(MODES)}"
        ) from None


def make_mode(
    settings: PrivacySettings, *, local: LocalTraining, state: StateDir, data_version: str
) -> PrivacyMode:
    """The device's one mode object, built once from its settings."""
    return mode_class(settings.mechanism)(
        settings=settings, local=local, state=state, data_version=data_version
    )
