"""The strategy interface, its registry, and the dense layout strategies work on."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from coordinator import aggregate as agg
from protocol import PrototypeUpdate

#: How a round's global prototypes come out of the workers' merged partial sums
#: (coordinator/tier/partial.py::global_prototypes): ``count``, the count-weighted mean;
#: ``paper``, with FedPCL's printed 1/|N_j|; ``client``, the holders' plain mean.
PartialMean = Literal["count", "paper", "client"]


@dataclass(frozen=True)
class RobustOptions:
    """Defences usable with any strategy.

    On by default, so one compromised device cannot steer a fleet whose operator changed
    nothing (docs/coordinator.md): ``median_count_cap`` caps the count each client may
    claim per class at that class's lower median count in the round, and FedAvg's and
    FPL's sample weights at the median device's; ``median_norm_clip`` clips every
    prototype row to the larger of 1 and its class's lower median row norm, and every
    averaged weight array to its lower median norm; ``median_direction_screen`` (FedPCL)
    leaves out of the global prototypes and the relayed local sets every row whose cosine
    to its class's coordinate-wise median is below half the median holder's
    (:func:`coordinator.aggregate.screen_directions`). Off by default: ``count_cap``, a fixed
    cap on the count one client may claim per class; ``norm_bound``, a fixed clip of
    prototype norms; ``rule``, the per-class mean replaced by a coordinate-wise median or
    trimmed mean (``trim`` at each end, at least one client whenever three hold a class).
    """

    count_cap: float | None = None
    norm_bound: float | None = None
    median_count_cap: bool = True
    median_norm_clip: bool = True
    median_direction_screen: bool = True
    rule: agg.Rule = "mean"
    trim: float = 0.1

    def __post_init__(self) -> None:
        if self.count_cap is not None and self.count_cap <= 0:
            raise ValueError(f"count_cap must be positive, got {self.count_cap}")
        if self.norm_bound is not None and self.norm_bound <= 0:
            raise ValueError(f"norm_bound must be positive, got {self.norm_bound}")
        if self.rule not in ("mean", "median", "trimmed_mean"):
            raise ValueError(f"rule must be mean, median or trimmed_mean, got {self.rule!r}")
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim}")


def _lower_median(values: np.ndarray) -> float:
    """A value one of the devices sent, the smaller of the middle two for an even number."""
    return float(np.quantile(values, 0.5, method="lower"))


#: The rows and counts as sent, no defence applied: what partial sums add up
#: (coordinator/tier/partial.py) and what the methods' own arithmetic is tested on.
RAW = RobustOptions(median_count_cap=False, median_norm_clip=False, median_direction_screen=False)


@dataclass(frozen=True)
class Dense:
    """Updates of one round in the dense layout of :mod:`coordinator.aggregate`."""

    clients: tuple[str, ...]
    protos: agg.F64  # (U, C, d)
    counts: agg.F64  # (U, C)
    extras: tuple[Mapping[str, np.ndarray], ...]

    @classmethod
    def from_updates(
        cls,
        updates: Sequence[PrototypeUpdate],
        *,
        num_classes: int,
        dim: int,
        robust: RobustOptions,
    ) -> Dense:
        protos = np.zeros((len(updates), num_classes, dim), dtype=np.float64)
        counts = np.zeros((len(updates), num_classes), dtype=np.float64)
        # Updates that report the same classes are scattered in one vectorised step per
        # group; a per-update loop costs most of a 10,000-client round.
        groups: dict[tuple[int, ...], list[int]] = {}
        for u, update in enumerate(updates):
            groups.setdefault(update.classes, []).append(u)
        for classes, members in groups.items():
            rows = np.asarray(members)[:, None]
            idx = np.asarray(classes, dtype=np.int64)[None, :]
            protos[rows, idx] = np.stack([updates[u].prototypes for u in members])
            counts[rows, idx] = np.asarray([updates[u].counts for u in members], dtype=np.float64)
        if robust.median_count_cap:
            counts = agg.cap_counts_at_median(counts)
        if robust.count_cap is not None:
            counts = agg.cap_counts(counts, robust.count_cap)
        if robust.median_norm_clip:
            protos = agg.clip_norms_at_median(protos, counts)
        if robust.norm_bound is not None:
            protos = agg.clip_norms(protos, robust.norm_bound)
        return cls(
            clients=tuple(u.client for u in updates),
            protos=protos,
            counts=counts,
            extras=tuple(u.extras for u in updates),
        )


@dataclass(frozen=True)
class Aggregate:
    """What a round's aggregation contributes to the next announcement."""

    global_classes: tuple[int, ...] = ()
    global_prototypes: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float64))
    local_sets: Mapping[str, np.ndarray] = field(default_factory=dict)
    client_globals: Mapping[str, np.ndarray] = field(default_factory=dict)
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)


def globals_of(values: agg.F64, has: np.ndarray) -> tuple[tuple[int, ...], agg.F64]:
    """The (class indices, rows) of the classes in ``has``."""
    return tuple(int(c) for c in np.flatnonzero(has)), values[has]


class Strategy(ABC):
    """One federated method's server side: turn a round's updates into an aggregate.

    Dropouts are input, not exceptions: ``aggregate`` receives whatever arrived.
    """

    name: str = ""

    @property
    def partial_mean(self) -> PartialMean | None:
        """How the sharded coordinator's owner divides the merged partial sums, for a
        method whose record ``splits`` and is no closed-form one; None for the rest."""
        return None

    def __init__(self, *, robust: RobustOptions | None = None) -> None:
        self.robust = robust or RobustOptions()

    def dense(self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int) -> Dense:
        return Dense.from_updates(updates, num_classes=num_classes, dim=dim, robust=self.robust)

    def combine(self, protos: agg.F64, counts: agg.F64) -> tuple[agg.F64, np.ndarray]:
        """Per-class unweighted reduction across clients under the configured robust rule."""
        return agg.combine(protos, counts, rule=self.robust.rule, trim=self.robust.trim)

    def average_weights(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int
    ) -> dict[str, np.ndarray]:
        """FedAvg's server step on the weight arrays clients send as extras: their
        sample-count-weighted mean (a coordinate-wise median under ``rule="median"``).
        Only clients that sent the same array names and shapes as the first are averaged."""
        if not updates:
            return {}
        shapes = {n: a.shape for n, a in updates[0].extras.items()}
        usable = [u for u in updates if {n: a.shape for n, a in u.extras.items()} == shapes]
        weights = np.array([float(sum(u.counts)) for u in usable])
        if self.robust.median_count_cap and weights.size:
            weights = np.minimum(weights, _lower_median(weights))
        if self.robust.count_cap is not None:
            weights = np.minimum(weights, self.robust.count_cap * num_classes)
        if not shapes or weights.sum() <= 0:
            return {}
        averaged = {}
        share = weights / weights.sum()
        for name in sorted(shapes):
            if self.robust.rule == "median":
                stack = np.stack([u.extras[name].astype(np.float64) for u in usable])
                averaged[name] = np.median(stack, axis=0)
                continue
            scale = np.ones(len(usable))
            if self.robust.median_norm_clip:
                # No array may pull harder than the median device's by being longer.
                norms = np.array([float(np.linalg.norm(u.extras[name])) for u in usable])
                scale = np.minimum(1.0, _lower_median(norms) / np.maximum(norms, 1e-12))
            # Summed update by update, not stacked: the stack of a thousand float64 copies
            # of a FedAvg head (2 GB over the full zoo's 896-d features) is never held.
            total = np.zeros(shapes[name], np.float64)
            for w, s, u in zip(share, scale, usable, strict=True):
                total += w * (u.extras[name] if s == 1.0 else s * u.extras[name])
            averaged[name] = total
        return averaged

    @abstractmethod
    def aggregate(
        self, updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int
    ) -> Aggregate:
        """Aggregate one round's accepted updates (possibly none)."""


StrategyFactory = Callable[..., Strategy]
_REGISTRY: dict[str, StrategyFactory] = {}


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def wrap(cls: type[Strategy]) -> type[Strategy]:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def make_strategy(name: str, *, robust: RobustOptions | None = None, **params: Any) -> Strategy:
    """Instantiate a registered strategy; an unknown name or parameter raises ValueError."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}; available: {', '.join(available())}"
        ) from None
    signature = {k: p for k, p in inspect.signature(factory).parameters.items() if k != "robust"}
    unknown = sorted(set(params) - set(signature))
    if unknown:
        raise ValueError(
            f"strategy {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters: {', '.join(signature) or 'none'}"
        )
    for key, value in params.items():
        # A parameter's default tells its type (an int is fine where a float is expected);
        # one without a default, or defaulting to None, is left to the strategy.
        default = signature[key].default
        want = type(default)
        if default not in (inspect.Parameter.empty, None) and not isinstance(
            value, (want, int) if want is float else want
        ):
            raise ValueError(
                f"strategy {name!r}: {key} must be of type {want.__name__}, got {value!r}"
            )
    try:
        return factory(robust=robust, **params)
    except TypeError as exc:  # a value of the wrong type, found by the strategy's arithmetic
        raise ValueError(f"bad parameters for strategy {name!r}: {exc}") from exc
