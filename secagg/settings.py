"""The public settings of a fleet's secure aggregation, the same on every party."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from secagg.noise import device_sigma2
from secagg.quantise import QuantiseSpec, max_devices

#: Standard deviations of the summed noise kept free in the ring: a discrete Gaussian
#: passes 10 sigma with probability below 1e-22, so the noised sum never wraps in practice.
NOISE_TAILS = 10


@dataclass(frozen=True, kw_only=True)
class SecAggSettings:
    """``threshold`` (t): the fewest devices, and the fewest shares of any one secret,
    a round may finish with. ``neighbours`` (k): how many peers each device pairs with
    (SecAgg+); ``k >= n - 1`` is the complete graph of the original protocol. Each device
    shares its secrets among its neighbours and itself, so ``t <= k + 1``. ``length``:
    the vector's dimension. ``sigma2``: the distributed discrete Gaussian's parameter for
    the whole sum, in quantisation units squared (None: no noise); each device adds its
    ``sigma2 / t`` part (:mod:`~secagg.noise`). The ring's width is ``spec.bits``.
    ``table``: the SHA-256 digest of the fleet's ``[secure_aggregation]`` table these
    settings were made from (secagg/fleet.py), which every advertisement carries and the
    coordinator checks against its own; empty when they were made without one.
    ``colluding`` (c): how many devices may side with the coordinator; a signed device
    requires ``2t > h + c`` of the ``h`` holders of its secrets (docs/privacy.md)."""

    threshold: int
    neighbours: int
    spec: QuantiseSpec
    length: int
    sigma2: int | Fraction | None = None
    table: bytes = b""
    colluding: int = 0

    def __post_init__(self) -> None:
        if type(self.threshold) is not int or self.threshold < 2:
            # Shamir with t = 1 would hand every neighbour the secret itself.
            raise ValueError(f"threshold {self.threshold} must be an integer of at least 2")
        if type(self.neighbours) is not int or self.neighbours + 1 < self.threshold:
            raise ValueError(
                f"{self.neighbours} neighbours hold {self.neighbours + 1} shares of each "
                f"secret (with the device's own), fewer than the threshold {self.threshold}"
            )
        if type(self.colluding) is not int or not 0 <= self.colluding < self.threshold:
            raise ValueError(f"colluding {self.colluding} must be in 0..threshold - 1")
        if type(self.length) is not int or self.length < 1:
            raise ValueError(f"vector length {self.length} must be a positive integer")
        if self.sigma2 is not None:
            device_sigma2(self.sigma2, threshold=self.threshold)
        if type(self.table) is not bytes or len(self.table) not in (0, 32):
            raise ValueError("table must be a 32-byte digest, or empty")

    def unsafe_for(self, holders: int) -> str | None:
        """Why a signed device refuses this ``t`` when ``holders`` devices (its
        neighbours and itself) hold its secrets, if it does: ``2t <= holders + c``. Each
        honest holder gives one share of the device's (its seed's or its key's), a
        colluder both, so below the bound survivor lists that differ rebuild both."""
        t, c = self.threshold, self.colluding
        if 2 * t > holders + c:
            return None
        return (
            f"t = {t} is not more than half of the {holders} holders of a device's secrets "
            f"plus c = {c}: survivor lists that differ could rebuild both"
        )

    def headroom(self, devices: int) -> int:
        """The integer room the summed noise of ``devices`` devices needs in the ring."""
        if self.sigma2 is None:
            return 0
        total = device_sigma2(self.sigma2, threshold=self.threshold) * devices
        return math.ceil(NOISE_TAILS * math.sqrt(total))

    def fits(self, devices: int) -> bool:
        """Whether the sum of ``devices`` inputs, noise included, stays inside the ring."""
        return devices <= max_devices(spec=self.spec, headroom=self.headroom(devices))
