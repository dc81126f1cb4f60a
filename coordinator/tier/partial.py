"""Partial sums: a round's aggregation split over several coordinator workers.

FedPCL's global prototype of class c (Eq. 6, ``weighting="count"``) is
``sum_i n_ic C_ic / sum_i n_ic``; its ``"paper"`` form divides that by the number of
clients holding c; FedProto's is ``sum_{i holds c} C_ic / holders_c``. Each is a ratio of
sums over clients, so any group of updates can be reduced to four per-class sums and any
set of such partial sums added: the result does not depend on how the updates were split.
A worker that sees a slice of the fleet (one member of an MQTT 5 shared subscription)
sends only its :class:`PartialSum`; a combiner merges the workers' and divides once
(docs/scale.md). What is not a sum does not split this way: the coordinate-wise median and
trimmed mean of ``RobustOptions.rule``, the per-round medians the default
``RobustOptions`` caps counts and clips norms at (a sharded fleet sets a fixed
``count_cap`` and ``norm_bound`` instead, docs/scale.md), and FedPCL's per-client local
sets (Eq. 7).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator import aggregate as agg

# A partial sum is of the counts and rows as sent: the median defences of the default
# RobustOptions need every update of the round at once, which no worker holds.
from coordinator.strategies.base import RAW, Dense, PartialMean
from protocol import PrototypeUpdate

#: ``count`` and ``paper`` are FedPCL's two weightings (coordinator/aggregate.py::
#: count_weighted_mean); ``client`` is the client-wise mean of FedProto (and FedDBP's
#: shared global set), aggregate.py::combine with ``rule="mean"``.
Mean = PartialMean


class OverlapError(ValueError):
    """Two partial sums cover the same client: merging them would count its update twice."""

    def __init__(self, clients: Iterable[str]) -> None:
        self.clients = tuple(sorted(clients))
        shown = ", ".join(self.clients[:5]) + (" ..." if len(self.clients) > 5 else "")
        super().__init__(f"{len(self.clients)} client(s) in more than one partial sum: {shown}")


@dataclass(frozen=True)
class PartialSum:
    """Per-class sums over the updates of ``clients`` (float64; C classes, d dimensions).

    ``weighted`` (C, d) is ``sum_i n_ic C_ic``; ``counts`` (C,) ``sum_i n_ic``; ``plain``
    (C, d) ``sum_i C_ic`` and ``holders`` (C,) the number of clients, both over the clients
    with ``n_ic > 0`` only (the holders of :func:`coordinator.aggregate.present_mask`).
    """

    weighted: agg.F64
    counts: agg.F64
    plain: agg.F64
    holders: np.ndarray
    clients: frozenset[str]

    def __post_init__(self) -> None:
        c, d = np.shape(self.weighted) if np.ndim(self.weighted) == 2 else (-1, -1)
        if c < 0 or np.shape(self.plain) != (c, d):
            raise ValueError("weighted and plain must both be (C, d)")
        if np.shape(self.counts) != (c,) or np.shape(self.holders) != (c,):
            raise ValueError(f"counts and holders must be ({c},)")
        arrays = (self.weighted, self.counts, self.plain)
        if not all(np.isfinite(a).all() for a in arrays):
            raise ValueError("a partial sum must be finite")
        if (np.asarray(self.counts) < 0).any() or (np.asarray(self.holders) < 0).any():
            raise ValueError("counts and holders must be non-negative")
        if int(np.asarray(self.holders).max(initial=0)) > len(self.clients):
            raise ValueError("a class has more holders than the partial sum has clients")

    @property
    def num_classes(self) -> int:
        return int(self.weighted.shape[0])

    @property
    def dim(self) -> int:
        return int(self.weighted.shape[1])

    @classmethod
    def empty(cls, *, num_classes: int, dim: int) -> PartialSum:
        return cls(
            weighted=np.zeros((num_classes, dim)),
            counts=np.zeros(num_classes),
            plain=np.zeros((num_classes, dim)),
            holders=np.zeros(num_classes, dtype=np.int64),
            clients=frozenset(),
        )


def _repeated(clients: Iterable[str]) -> set[str]:
    return {client for client, n in Counter(clients).items() if n > 1}


def partial_of(updates: Sequence[PrototypeUpdate], *, num_classes: int, dim: int) -> PartialSum:
    """The partial sum of ``updates``, laid out as the strategies lay them out
    (:class:`coordinator.strategies.base.Dense`, no robust options). Refuses two updates
    from one client: the store keeps one update per (round, client), so must a partial."""
    clients = frozenset(u.client for u in updates)
    if len(clients) != len(updates):
        raise OverlapError(_repeated(u.client for u in updates))
    d = Dense.from_updates(updates, num_classes=num_classes, dim=dim, robust=RAW)
    weighted, counts = agg.weighted_sums(d.protos, d.counts)  # (C, d), (C,)
    plain, holders = agg.client_sums(d.protos, d.counts)
    return PartialSum(
        weighted=weighted,
        counts=counts,
        plain=plain,
        holders=holders.astype(np.int64),
        clients=clients,
    )


def merge(partials: Iterable[PartialSum]) -> PartialSum:
    """The partial sum of the union of the partials' updates.

    Associative and commutative (up to float64 rounding, see :func:`global_prototypes`).
    Refuses partials of different shapes, and partials that share a client: one update
    must never be counted twice. An empty iterable is refused too (its shape is unknown).
    """
    parts = list(partials)
    if not parts:
        raise ValueError("merge needs at least one partial sum")
    shape = (parts[0].num_classes, parts[0].dim)
    if any((p.num_classes, p.dim) != shape for p in parts):
        raise ValueError(f"partial sums of different shapes; expected {shape}")
    clients = frozenset().union(*(p.clients for p in parts))
    if len(clients) != sum(len(p.clients) for p in parts):
        raise OverlapError(_repeated(c for p in parts for c in p.clients))
    return PartialSum(
        weighted=np.sum([p.weighted for p in parts], axis=0),
        counts=np.sum([p.counts for p in parts], axis=0),
        plain=np.sum([p.plain for p in parts], axis=0),
        holders=np.sum([p.holders for p in parts], axis=0).astype(np.int64),
        clients=clients,
    )


def global_prototypes(partial: PartialSum, *, mean: Mean = "count") -> tuple[agg.F64, agg.Mask]:
    """Global prototypes (C, d) and the (C,) mask of classes that have one, as
    :func:`coordinator.aggregate.count_weighted_mean` (``count``, ``paper``) or
    :func:`coordinator.aggregate.combine` with ``rule="mean"`` (``client``) return them
    for the same updates.

    Equal to within float64 rounding, not bit for bit: addition of floats is not
    associative, and summing per group then across groups rounds at other points than one
    sum over all updates (relative differences of order 1e-16 times the number of terms).
    """
    if mean == "client":
        return agg.mean_of_sums(partial.plain, partial.holders)
    if mean not in ("count", "paper"):
        raise ValueError(f"unknown mean {mean!r}; use 'count', 'paper' or 'client'")
    holders = partial.holders if mean == "paper" else None
    return agg.mean_of_sums(partial.weighted, partial.counts, holders=holders)
