"""What a device's privacy settings cost and release, round by round: the ledger events
of a dp round (from public settings alone), the mechanism's parameters, and the
dp-features release made and paid for once per data version."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from edge_agent.privacy.accounting import (
    Event,
    gaussian_release,
    per_part_sigma,
    release_event,
    sgd_schedule,
)
from edge_agent.privacy.ledger import Ledger
from edge_agent.privacy.mechanisms import MechanismParams, Release
from edge_agent.privacy.randomness import NoiseSource
from edge_agent.privacy.settings import PrivacySettings
from edge_agent.state import StateDir
from edge_agent.train_config import TrainConfig
from runtime.faults import crash_point

log = logging.getLogger(__name__)

T = TypeVar("T")


class Spending:
    """A device's privacy plan and its ledger. ``noise`` is the mechanisms' randomness
    (secret unless the configuration asks for replayable noise)."""

    def __init__(
        self, *, settings: PrivacySettings, train: TrainConfig, ledger: Ledger, noise: NoiseSource
    ) -> None:
        self.settings = settings
        self.train = train
        self.ledger = ledger
        self.noise = noise

    def feature_release(
        self,
        round_: int,
        *,
        state: StateDir,
        data_version: str,
        features: np.ndarray,
        labels: np.ndarray,
        num_classes: int,
    ) -> tuple[Release, float] | None:
        """This data version's dp-features release and the epsilon spent: made (and paid
        for) once per data version, stored, and sent again every round after that as
        post-processing. None if a new release would exceed the budget."""
        return self._once(
            round_,
            stored=state.load_feature_release(data_version),
            event=self.release_event(),
            make=lambda: self.settings.spec.release(
                features, labels, num_classes, self.mechanism_params(), self.noise.numpy
            ),
            save=lambda release: state.save_feature_release(data_version, release),
            what=f"data version {data_version[:12]} released in feature space",
        )

    def _once(
        self,
        round_: int,
        *,
        stored: T | None,
        event: Event,
        make: Callable[[], T],
        save: Callable[[T], None],
        what: str,
    ) -> tuple[T, float] | None:
        """A release made and paid for once: the ``stored`` one again (post-processing, no
        new epsilon), else a new one if the budget allows ``event``, else None."""
        if stored is not None:
            return stored, self.ledger.spent()
        if not self.ledger.allows([event]):
            return None
        release = make()
        # Durable before the release exists anywhere: a crash from here on can only make
        # the device pay again for a release that never left it.
        spent = self.ledger.record(round_, [event], reproducible=self.noise.reproducible)
        crash_point("after_ledger_write")
        save(release)
        log.info("%s (epsilon spent %.3g)", what, spent)
        return release, spent

    def statistics_release(
        self,
        round_: int,
        *,
        state: StateDir,
        data_version: str,
        make: Callable[[float, np.random.Generator], dict[str, np.ndarray]],
    ) -> tuple[dict[str, np.ndarray], float] | None:
        """This data version's noisy class statistics (a closed-form method's) and the
        epsilon spent. ``make(noise_multiplier, rng)`` draws the release: one Gaussian
        mechanism of that multiplier over everything it sends
        (``edge_agent/closed_form.py::noisy_release``). Made and paid for once per data
        version, stored, and sent again as post-processing after that. None if a new
        release would exceed the budget."""
        return self._once(
            round_,
            stored=state.load_statistics_release(data_version),
            event=self.statistics_event(),
            make=lambda: make(self.settings.release_noise_multiplier, self.noise.numpy),
            save=lambda release: state.save_statistics_release(data_version, release),
            what=f"data version {data_version[:12]}: class statistics released",
        )

    def statistics_event(self) -> Event:
        """The statistics release as the accountant sees it: one Gaussian mechanism of
        multiplier ``release_noise_multiplier`` (noise std over L2 sensitivity), the
        same event as a dp-features release of that multiplier."""
        return gaussian_release(self.settings.release_noise_multiplier)

    def mechanism_params(self) -> MechanismParams:
        p = self.settings
        s = per_part_sigma(p.release_noise_multiplier)
        return MechanismParams(paper_noise=p.paper_noise, paper_scale=p.paper_scale,
                               paper_p=p.paper_p, sum_sigma=s, count_sigma=s)  # fmt: skip

    def schedule(self) -> Any:
        p = self.settings
        assert p.dataset_size is not None  # the configuration requires it for dp
        return sgd_schedule(
            dataset_size=p.dataset_size, batch=self.train.batch_size, epochs=self.train.epochs
        )

    def release_event(self) -> Event:
        s = per_part_sigma(self.settings.release_noise_multiplier)
        return release_event(s, s)

    def dp_events(self) -> list[Event]:
        """One dp round's spend, its DP-SGD steps and its release: a function of the
        public settings alone (the same before and after training, for any data set
        within privacy.dataset_size)."""
        schedule = self.schedule()
        return [
            Event(self.settings.sgd_noise_multiplier, schedule.sample_rate, schedule.steps),
            self.release_event(),
        ]
