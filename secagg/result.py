"""A secure-aggregation round's outcome, as :class:`~secagg.server.SecAggServer` returns it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from secagg.messages import Stage


@dataclass(frozen=True, eq=False, kw_only=True)
class SecAggResult:
    """The round's outcome: ``total`` (float64, ``(length,)``) is the decoded sum of the
    inputs of ``survivors``, noise included; ``dropped`` names who failed to answer each
    stage (advertising is joining, so nobody drops from it)."""

    total: np.ndarray
    survivors: tuple[str, ...]
    dropped: Mapping[Stage, tuple[str, ...]] = field(default_factory=dict)
