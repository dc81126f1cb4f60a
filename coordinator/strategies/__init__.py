"""Server-side strategies, one per method, behind a name-keyed registry."""

from coordinator.strategies import (  # noqa: F401  (registration)
    closed_form,
    fedavg,
    feddbp,
    fedpcl,
    fedproto,
    fpl,
    solo,
)
from coordinator.strategies.base import (
    Aggregate,
    Dense,
    RobustOptions,
    Strategy,
    available,
    make_strategy,
)

__all__ = ["Aggregate", "Dense", "RobustOptions", "Strategy", "available", "make_strategy"]
