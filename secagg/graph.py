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
    if k >= n - 1:
        return [frozenset(set(range(n)) - {i}) for i in range(n)]
    edges: set[tuple[int, int]] = set()
    for i in range(n):
        for step in range(1, k // 2 + 1):
            edges.add((i, (i + step) % n))
    if k % 2 == 1:
        if n % 2 == 0:
            edges.update((i, i + n // 2) for i in range(n // 2))
        else:
            # Harary's rule for odd k and n: vertices 0..(n-1)/2 each reach (n+1)/2 ahead,
            # which gives vertex 0 two extra edges and every other vertex one.
            edges.update((i, (i + (n + 1) // 2) % n) for i in range((n - 1) // 2 + 1))
    adjacent: list[set[int]] = [set() for _ in range(n)]
    for a, b in edges:
        adjacent[a].add(b)
        adjacent[b].add(a)
    return [frozenset(s) for s in adjacent]


def graph_seed(clients: Iterable[str], *, fleet: str, round: int) -> bytes:
    """The public seed: SHA-256 of the label, fleet, round and sorted client ids, each
    length-prefixed so that no two inputs encode alike."""
    fields = [fleet.encode(), str(round).encode(), *(c.encode() for c in sorted(clients))]
    return hashlib.sha256(_LABEL + b"".join(_prefixed(f) for f in fields)).digest()


def neighbour_graph(
    clients: Iterable[str], *, k: int, fleet: str, round: int
) -> Mapping[str, frozenset[str]]:
    """Each device's neighbours: symmetric, nobody its own neighbour, the same for any
    order of ``clients``."""
    ids = sorted(clients)
    if len(set(ids)) != len(ids):
        raise ValueError("the device list names a device twice")
    seed = graph_seed(ids, fleet=fleet, round=round)
    order = sorted(ids, key=lambda c: hashlib.sha256(seed + _prefixed(c.encode())).digest())
    adjacent = harary(len(order), k)
    return {order[i]: frozenset(order[j] for j in adjacent[i]) for i in range(len(order))}


def _prefixed(field: bytes) -> bytes:
    return len(field).to_bytes(2, "big") + field
