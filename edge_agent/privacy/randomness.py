"""Where a privacy mechanism's randomness comes from, and what guarantee that leaves.

Subsampling amplification and the Gaussian mechanism both assume that nobody can predict
the draws: a Poisson mask or a noise vector an observer can replay from a known seed
protects nothing (the seed is in the configuration and in every report). Mechanism
randomness therefore comes from the operating system's cryptographically secure source
(``secrets``), which seeds one numpy and one torch generator per agent life. The run's
``seed`` keeps controlling only what is public: partitions, initialisation, data order.

Reproducible noise (a fixed seed) exists for experiments alone; whatever it touches says
``guarantee: none (reproducible noise)``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

#: The guarantee a formal mechanism gives with secret randomness.
DP_GUARANTEE = "(epsilon, delta)-DP, add/remove one example"
#: What any mechanism gives when its randomness can be replayed.
REPRODUCIBLE = "none (reproducible noise)"
#: What the mechanisms without a formal claim give.
NONE = "none"


@dataclass(frozen=True)
class NoiseSource:
    """One agent's mechanism randomness: numpy for releases, torch for DP-SGD's Poisson
    masks and gradient noise."""

    numpy: np.random.Generator
    torch: torch.Generator
    reproducible: bool

    @classmethod
    def create(cls, reproducible_seed: int | None = None) -> NoiseSource:
        # Here, not at the top: reading a configuration (its guarantee) must not import torch.
        import torch

        if reproducible_seed is not None:
            return cls(
                np.random.default_rng(reproducible_seed),
                torch.Generator().manual_seed(reproducible_seed),
                reproducible=True,
            )
        return cls(
            np.random.default_rng(secrets.randbits(128)),
            torch.Generator().manual_seed(secrets.randbits(64)),
            reproducible=False,
        )


def guarantee(*, formal: bool, reproducible: bool) -> str:
    """What a release can claim: ``formal`` for the dp mechanisms."""
    if not formal:
        return NONE
    return REPRODUCIBLE if reproducible else DP_GUARANTEE
