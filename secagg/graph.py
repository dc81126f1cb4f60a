"""The SecAgg+ neighbour graph: whom each device pairs with, drawn from a public seed.

Bell et al. (CCS 2020) replace the complete graph of Bonawitz et al. with a sparse one of
degree ``k``: each device masks with, and shares its secrets among, its ``k`` neighbours
only. Following them, the graph is a Harary graph ``H(k, n)`` (the circulant graph that
joins each vertex to its ``k // 2`` nearest on either side of a ring, plus the opposite
vertex when ``k`` is odd) laid over the devices in an order the seed shuffles. Harary
graphs are ``k``-connected with the fewest edges for that, and every vertex has degree
``k`` (one has ``k + 1`` when ``k`` and ``n`` are both odd, since no ``k``-regular graph
on an odd number of vertices exists then).

The seed is SHA-256 of the fleet, the round and the sorted list of the devices that
advertised keys, so every party (each device and the coordinator) computes the same graph
and a coordinator cannot hand one device a graph of its own choosing. The shuffle sorts
the devices by SHA-256 of seed and id: plain hashing, which a device written in another
language can repeat, rather than Python's ``random`` whose algorithms are not a contract.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

_LABEL = b"protofleet/secagg/graph/v1"


def harary(n: int, k: int) -> list[frozenset[int]]:
    """The neighbours of each vertex ``0..n-1`` of ``H(k, n)``; the complete graph when
    ``k >= n - 1``."""
    if n < 1:
        raise ValueError(f"a graph needs at least one vertex, not {n}")
    if k < 1:
        raise ValueError(f"neighbour count {k} must be at least 1")
    return [harary_row(n, k, i) for i in range(n)]


def harary_row(n: int, k: int, i: int) -> frozenset[int]:
    """Vertex ``i``'s neighbours in ``H(k, n)``, as :func:`harary` gives them, without the
    rest of the graph: a device needs only its own row, and building all ``n`` of them on
    every device made a 10,000-device fleet's in-memory round quadratic."""
    if not 0 <= i < n:
        raise ValueError(f"vertex {i} is not in 0..{n - 1}")
    if k < 1:
        raise ValueError(f"neighbour count {k} must be at least 1")
    if k >= n - 1:
        return frozenset(range(n)) - {i}
    out = {(i + step) % n for step in range(1, k // 2 + 1)}
    out |= {(i - step) % n for step in range(1, k // 2 + 1)}
    if k % 2 == 1:
        if n % 2 == 0:
            out.add((i + n // 2) % n)
        else:
            half = (n + 1) // 2  # vertices 0..(n-1)/2 reach half ahead (see harary)
            if i <= (n - 1) // 2:
                out.add((i + half) % n)
            if (i - half) % n <= (n - 1) // 2:
                out.add((i - half) % n)
    return frozenset(out)


def graph_seed(clients: Iterable[str], *, fleet: str, round: int) -> bytes:
    """The public seed: SHA-256 of the label, fleet, round and sorted client ids, each
    length-prefixed so that no two inputs encode alike."""
    fields = [fleet.encode(), str(round).encode(), *(c.encode() for c in sorted(clients))]
    return hashlib.sha256(_LABEL + b"".join(_prefixed(f) for f in fields)).digest()


class Ring:
    """The devices in the seed's shuffled order, the ring the Harary graph is laid on:
    any device's row (:meth:`row`) in ``O(k)`` once the order is known."""

    def __init__(self, clients: Iterable[str], *, k: int, fleet: str, round: int) -> None:
        ids = sorted(clients)
        if len(set(ids)) != len(ids):
            raise ValueError("the device list names a device twice")
        seed = graph_seed(ids, fleet=fleet, round=round)
        self.k = k
        self.order = sorted(
            ids, key=lambda c: hashlib.sha256(seed + _prefixed(c.encode())).digest()
        )
        self._at = {c: i for i, c in enumerate(self.order)}

    def row(self, client: str) -> frozenset[str]:
        """``client``'s neighbours; KeyError when it is not on the ring."""
        return frozenset(
            self.order[j] for j in harary_row(len(self.order), self.k, self._at[client])
        )


def neighbour_graph(
    clients: Iterable[str], *, k: int, fleet: str, round: int
) -> Mapping[str, frozenset[str]]:
    """Each device's neighbours: symmetric, nobody its own neighbour, the same for any
    order of ``clients``."""
    ring = Ring(clients, k=k, fleet=fleet, round=round)
    return {c: ring.row(c) for c in ring.order}


def holder_xs(owner: str, neighbours: Iterable[str]) -> dict[str, int]:
    """The Shamir x-coordinate of each holder of ``owner``'s secrets (its neighbours and
    itself): its rank, from 1, among them sorted. Relative to the owner, not the roster,
    so every neighbourhood that answers in full rebuilds from the same x-set and the
    coordinator's Lagrange weights (secagg/shamir.py, cached) are computed once a round
    rather than once a device: at 1,000 devices of 100 neighbours they were 64 s of the
    coordinator's 60-70."""
    return {v: r + 1 for r, v in enumerate(sorted({owner, *neighbours}))}


class HolderXs(dict[str, dict[str, int]]):
    """:func:`holder_xs` of each device of ``graph``, computed when first asked for: the
    coordinator places every share of a round with it."""

    def __init__(self, graph: Mapping[str, frozenset[str]]) -> None:
        super().__init__()
        self._graph = graph

    def __missing__(self, owner: str) -> dict[str, int]:
        self[owner] = xs = holder_xs(owner, self._graph[owner])
        return xs


def _prefixed(field: bytes) -> bytes:
    return len(field).to_bytes(2, "big") + field
