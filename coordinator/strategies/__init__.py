"""Server-side strategies, one per method, behind a name-keyed registry."""

from coordinator.strategies import fedavg, feddbp, fedpcl, fedproto, fpl, solo  # noqa: F401  (registration)
from coordinator.strategies.base import (
    Aggregate,
    Dense,
    RobustOptions,
    Strategy,
    available,
    make_strategy,
)

__all__ = ["Aggregate", "Dense", "RobustOptions", "Strategy", "available", "make_strategy"]
