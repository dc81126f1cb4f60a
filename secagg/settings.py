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
    requires ``2t > h + c`` of the ``h`` holders of its secrets (docs/privacy.md).
    ``quorum`` (T): the fewest survivors a round may finish with across the fleet, and the
    fewest signatures on its survivor list a device wants before it releases a share; 0
    reads as ``t`` (the complete graph's one threshold). On a sparse graph ``t`` is a
    neighbourhood's and ``T`` the fleet's: each device adds ``sigma2 / T`` of the noise,
    and a signed device requires ``2T > n + c`` of the ``n`` devices in its roster, so no
    two survivor lists both gather ``T`` signatures."""

    threshold: int
    neighbours: int
    spec: QuantiseSpec
    length: int
    sigma2: int | Fraction | None = None
    table: bytes = b""
    colluding: int = 0
    quorum: int = 0

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
        if type(self.quorum) is not int or 0 < self.quorum < self.threshold:
            raise ValueError(
                f"quorum {self.quorum} must be 0 (the threshold) or at least threshold "
                f"{self.threshold}: a round cannot finish with fewer devices than t"
            )
        if type(self.length) is not int or self.length < 1:
            raise ValueError(f"vector length {self.length} must be a positive integer")
        if self.sigma2 is not None:
            device_sigma2(self.sigma2, threshold=self.fewest)
        if type(self.table) is not bytes or len(self.table) not in (0, 32):
            raise ValueError("table must be a 32-byte digest, or empty")

    @property
    def fewest(self) -> int:
        """T: the fewest survivors a round may finish with (``quorum``, else ``threshold``)."""
        return self.quorum or self.threshold

    @property
    def least(self) -> str:
        """How messages name the fewest survivors: ``t = 7``, or ``T = 900`` where the
        fleet's quorum is above the threshold."""
        if self.fewest == self.threshold:
            return f"t = {self.threshold}"
        return f"T = {self.fewest}"

    @property
    def least_named(self) -> str:
        """``threshold t = 7``, or ``quorum T = 900``: :attr:`least` with its name."""
        return ("threshold " if self.fewest == self.threshold else "quorum ") + self.least

    def unsafe_for(self, holders: int, devices: int | None = None) -> str | None:
        """Why a signed device refuses this ``t`` when ``holders`` devices (its
        neighbours and itself) hold its secrets, or this ``T`` when ``devices`` are in its
        roster, if it does. ``2t <= holders + c``: each honest holder gives one share of
        the device's (its seed's or its key's), a colluder both, so below the bound
        survivor lists that differ rebuild both. ``2T <= devices + c``: honest devices
        sign one survivor list each and colluders any number, so below the bound two
        lists could each gather ``T`` signatures, and holders of different devices'
        secrets be told different lists (docs/privacy.md, the sparse graph)."""
        t, c = self.threshold, self.colluding
        if 2 * t <= holders + c:
            return (
                f"t = {t} is not more than half of the {holders} holders of a device's "
                f"secrets plus c = {c}: survivor lists that differ could rebuild both"
            )
        if devices is not None and 2 * self.fewest <= devices + c:
            return (
                f"T = {self.fewest} is not more than half of the {devices} devices in the "
                f"roster plus c = {c}: two survivor lists could each gather T signatures"
            )
        return None

    def headroom(self, devices: int) -> int:
        """The integer room the summed noise of ``devices`` devices needs in the ring."""
        if self.sigma2 is None:
            return 0
        total = device_sigma2(self.sigma2, threshold=self.fewest) * devices
        return math.ceil(NOISE_TAILS * math.sqrt(total))

    def fits(self, devices: int) -> bool:
        """Whether the sum of ``devices`` inputs, noise included, stays inside the ring."""
        return devices <= max_devices(spec=self.spec, headroom=self.headroom(devices))
