"""The coordinator's ``[closed_form]`` table: what a device of lda, ridge or fedcof may send
(coordinator/statistics_checks.py) and how far one device's statistics may weigh in the
fleet's sum (closed_form/robust.py). Read by every closed-form fleet; ignored by the others."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from closed_form import SENSITIVITY
from closed_form.arrays import F64
from closed_form.basis import load_basis_id, setting_basis
from closed_form.projection import basis_check
from coordinator.statistics_checks import StatisticsBounds

#: L2 sensitivity of FedCOF's release (sums and counts, no second moment).
FEDCOF_SENSITIVITY = math.sqrt(2.0)


@dataclass(frozen=True)
class ClosedFormSettings:
    """``release``: what the fleet's devices send, ``exact`` (privacy.mechanism = "none")
    or ``noisy`` (a Gaussian release, privacy.mechanism = "dp-features" or "dp", of the
    devices' ``privacy.release_noise_multiplier``, given here as ``noise_multiplier``).
    The fleet's setting decides how an update is checked, never the update's own
    privacy field: an update that says otherwise is refused (``wrong_release``).

    ``max_samples``: the public bound on one device's samples over all its classes
    (a device with more data must not join without it being raised). ``count_cap``: a
    device's weight in a class is capped at this multiple of the class's lower median
    count among the devices holding it, its sums and second moment scaled to match
    (0: no cap); a fleet of similar devices is not changed by it.

    ``basis``: the path of the fleet's public basis (closed_form/basis.py), the same file
    as the devices' ``closed_form.basis``; "" for the random projection. A release's basis
    check is held to it (coordinator/admission.py)."""

    release: Literal["exact", "noisy"] = "exact"
    noise_multiplier: float = 5.0
    max_samples: float = 100_000.0
    count_cap: float = 1.0
    basis: str = ""

    def __post_init__(self) -> None:
        if self.release not in ("exact", "noisy"):
            raise ValueError(f'release must be "exact" or "noisy", got {self.release!r}')
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ValueError(f"noise_multiplier must be positive, got {self.noise_multiplier}")
        if not 1 <= self.max_samples <= 1e9:
            raise ValueError(f"max_samples must be in [1, 1e9], got {self.max_samples}")
        if not (self.count_cap == 0 or 1 <= self.count_cap <= 1e6):
            raise ValueError(f"count_cap must be 0 (no cap) or in [1, 1e6], got {self.count_cap}")

    def public_basis(self, feature_dim: int) -> F64 | None:
        """The public basis for ``feature_dim`` features (0: any size); None without one."""
        return setting_basis(self.basis, feature_dim=feature_dim)

    def basis_check(self, *, fleet: str, feature_dim: int, dim: int) -> F64 | None:
        """The basis check of the public basis at ``dim`` (None without one): what the
        devices' statistics are made in, bound into a secure round's settings."""
        public = self.public_basis(feature_dim)
        return None if public is None else basis_check(fleet, public.shape[0], dim, basis=public)

    def identity(self, feature_dim: int) -> dict[str, str]:
        """What the public basis adds to the coordinator state's identity (its content's
        ``basis_id``): nothing without one, so older state keeps its identity."""
        public = self.public_basis(feature_dim)
        return {} if public is None else {"basis": load_basis_id(self.basis)}

    def sigma(self, *, gram: bool) -> float:
        """The noise's standard deviation on each released coordinate (0: exact), as a
        device computes it (edge_agent/closed_form.py::noisy_release)."""
        if self.release == "exact":
            return 0.0
        return self.noise_multiplier * (SENSITIVITY if gram else FEDCOF_SENSITIVITY)

    def bounds(self, *, gram: bool, unit_rows: bool) -> StatisticsBounds:
        return StatisticsBounds(
            max_samples=self.max_samples, sigma=self.sigma(gram=gram), unit_rows=unit_rows
        )
