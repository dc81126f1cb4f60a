"""The SecAgg+ neighbour graph: Harary graphs worked by hand, then symmetry, degree and
determinism over many fleet sizes, and the public seed rebuilt independently."""

import hashlib

import pytest

from secagg.graph import graph_seed, harary, neighbour_graph


def test_harary_even_k_is_a_ring_of_nearest_neighbours() -> None:
    assert harary(6, 2) == [{1, 5}, {0, 2}, {1, 3}, {2, 4}, {3, 5}, {4, 0}]
    assert harary(7, 4)[0] == {1, 2, 5, 6}


def test_harary_odd_k_even_n_adds_the_opposite_vertex() -> None:
    assert harary(6, 3) == [{1, 5, 3}, {0, 2, 4}, {1, 3, 5}, {2, 4, 0}, {3, 5, 1}, {4, 0, 2}]


def test_harary_odd_k_odd_n_gives_vertex_zero_one_extra_edge() -> None:
    # Ring 0-1-2-3-4-0, then (0, 3), (1, 4) and (2, 0): vertex 0 reaches degree 4.
    assert harary(5, 3) == [{1, 2, 3, 4}, {0, 2, 4}, {0, 1, 3}, {0, 2, 4}, {0, 1, 3}]


def test_harary_with_k_at_least_n_minus_1_is_complete() -> None:
    assert harary(4, 3) == harary(4, 50) == [{1, 2, 3}, {0, 2, 3}, {0, 1, 3}, {0, 1, 2}]
    assert harary(1, 1) == [set()]


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 20, 21])
def test_neighbour_graph_is_symmetric_without_loops_and_of_degree_k(n: int) -> None:
    clients = [f"dev-{i}" for i in range(n)]
    for k in range(1, n + 2):
        graph = neighbour_graph(clients, k=k, fleet="lab", round=4)
        assert set(graph) == set(clients)
        for u, near in graph.items():
            assert u not in near
            assert all(u in graph[v] for v in near)
        degrees = sorted(len(near) for near in graph.values())
        if k >= n - 1:
            assert degrees == [n - 1] * n
        elif k % 2 == 1 and n % 2 == 1:
            assert degrees == [k] * (n - 1) + [k + 1]
        else:
            assert degrees == [k] * n


def test_neighbour_graph_is_the_same_for_any_order_and_every_party() -> None:
    clients = [f"dev-{i}" for i in range(12)]
    first = neighbour_graph(clients, k=4, fleet="lab", round=7)
    assert neighbour_graph(list(reversed(clients)), k=4, fleet="lab", round=7) == first
    assert neighbour_graph(set(clients), k=4, fleet="lab", round=7) == first


def test_neighbour_graph_changes_with_round_fleet_and_devices() -> None:
    clients = [f"dev-{i}" for i in range(12)]
    base = neighbour_graph(clients, k=4, fleet="lab", round=7)
    assert neighbour_graph(clients, k=4, fleet="lab", round=8) != base
    assert neighbour_graph(clients, k=4, fleet="lab2", round=7) != base
    assert neighbour_graph([*clients[:-1], "dev-x"], k=4, fleet="lab", round=7) != base


def test_graph_seed_is_sha256_of_the_length_prefixed_fields() -> None:
    expected = hashlib.sha256(
        b"protofleet/secagg/graph/v1\x00\x03lab\x00\x012\x00\x01a\x00\x02bb"
    ).digest()
    assert graph_seed(["bb", "a"], fleet="lab", round=2) == expected


def test_a_device_named_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        neighbour_graph(["a", "b", "a"], k=2, fleet="lab", round=1)


def _harary_by_edges(n: int, k: int) -> list[set[int]]:
    """H(k, n) from its edge list (Harary's construction), the reference for the rows."""
    if k >= n - 1:
        return [set(range(n)) - {i} for i in range(n)]
    edges = {(i, (i + s) % n) for i in range(n) for s in range(1, k // 2 + 1)}
    if k % 2 == 1:
        half = n // 2 if n % 2 == 0 else (n + 1) // 2
        edges |= {(i, (i + half) % n) for i in range(n // 2 if n % 2 == 0 else (n - 1) // 2 + 1)}
    adjacent: list[set[int]] = [set() for _ in range(n)]
    for a, b in edges:
        adjacent[a].add(b)
        adjacent[b].add(a)
    return adjacent


@pytest.mark.parametrize("n", [1, 2, 5, 6, 11, 12, 31])
def test_each_row_is_computed_alone_as_the_edge_list_gives_it(n: int) -> None:
    for k in range(1, n + 1):
        assert [set(r) for r in harary(n, k)] == _harary_by_edges(n, k)
