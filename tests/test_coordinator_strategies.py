import numpy as np
import pytest

from coordinator.strategies import RobustOptions, available, make_strategy
from coordinator.strategies.base import RAW
from protocol import PrototypeUpdate


def update(client, classes, counts, protos, **extras):
    return PrototypeUpdate(
        fleet="lab",
        round=0,
        client=client,
        bundle="b",
        method="x",
        classes=tuple(classes),
        counts=tuple(counts),
        prototypes=np.asarray(protos, dtype=np.float32),
        extras={k: np.asarray(v, dtype=np.float32) for k, v in extras.items()},
    )


# RAW: each method's arithmetic on the rows as sent; the default median defences have
# tests of their own (tests/test_coordinator_defaults.py).

A = update("a", [0, 1], [2, 1], [[1, 0], [0, 1]])
B = update("b", [1, 2], [3, 4], [[1, 0], [0.6, 0.8]])


def test_registry_lists_every_method_and_fails_loudly():
    assert available() == (
        "fedavg", "fedcof", "feddbp", "fedpcl", "fedproto", "fpl", "lda", "ridge", "solo"
    )  # fmt: skip
    with pytest.raises(ValueError, match="unknown strategy 'fedsgd'"):
        make_strategy("fedsgd")
    with pytest.raises(ValueError, match="'fedpcl' has no parameter 'colour'; its parameters: "):
        make_strategy("fedpcl", colour="red")
    with pytest.raises(ValueError, match=r"'solo' has no parameter 'weighting'; .*: none"):
        make_strategy("solo", weighting="paper")
    with pytest.raises(ValueError, match="top_k must be of type int, got 'x'"):
        make_strategy("feddbp", top_k="x")
    assert (
        vars(make_strategy("feddbp", eta=1))["eta"] == 1
    )  # an int where a float is expected is fine
    with pytest.raises(ValueError, match="weighting"):
        make_strategy("fedpcl", weighting="median")


def test_fedpcl_globals_and_padded_sets():
    result = make_strategy("fedpcl", robust=RAW).aggregate([A, B], num_classes=3, dim=2)
    assert result.global_classes == (0, 1, 2)
    np.testing.assert_allclose(
        result.global_prototypes, [[1.0, 0.0], [0.75, 0.25], [0.6, 0.8]], rtol=1e-6
    )
    np.testing.assert_allclose(
        result.local_sets["a"], [[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], rtol=1e-6
    )
    np.testing.assert_allclose(
        result.local_sets["b"], [[1.0, 0.0], [1.0, 0.0], [0.6, 0.8]], rtol=1e-6
    )


def test_fedproto_is_the_unweighted_client_mean():
    result = make_strategy("fedproto").aggregate([A, B], num_classes=3, dim=2)
    np.testing.assert_allclose(result.global_prototypes[1], [0.5, 0.5])


def test_robust_median_resists_one_outlier():
    honest = [update(f"h{i}", [0], [10], [[1.0, 0.0]]) for i in range(4)]
    liar = update("liar", [0], [1e9], [[-50.0, 50.0]])
    plain = make_strategy("fedpcl", robust=RAW).aggregate([*honest, liar], num_classes=1, dim=2)
    assert plain.global_prototypes[0, 0] < 0  # the huge claimed count wins
    robust = make_strategy(
        "fedpcl", robust=RobustOptions(count_cap=100, norm_bound=1.0, rule="median")
    )
    result = robust.aggregate([*honest, liar], num_classes=1, dim=2)
    np.testing.assert_allclose(result.global_prototypes[0], [1.0, 0.0])


def test_robust_options_validate():
    with pytest.raises(ValueError):
        RobustOptions(rule="mode")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RobustOptions(trim=0.5)


def test_fpl_chains_first_neighbours_into_one_cluster():
    # a <-> b are mutual first neighbours and c's first neighbour is b: one component.
    ups = [
        update("a", [0], [1], [[1.0, 0.0]]),
        update("b", [0], [1], [[0.98, 0.2]]),
        update("c", [0], [1], [[0.0, 1.0]]),
    ]
    result = make_strategy("fpl").aggregate(ups, num_classes=1, dim=2)
    np.testing.assert_allclose(result.extras["clusters"], [[0.66, 0.4]], rtol=1e-6)
    np.testing.assert_allclose(result.global_prototypes, [[0.66, 0.4]], rtol=1e-6)
    np.testing.assert_array_equal(result.extras["cluster_classes"], [0.0])


def test_fpl_unbiased_differs_from_the_plain_mean_when_a_domain_dominates():
    ups = [update(f"d{i}", [0], [1], [[1.0, 0.01 * i]]) for i in range(4)]
    ups += [update("x", [0], [1], [[-1.0, 0.0]]), update("y", [0], [1], [[-1.0, 0.01]])]
    result = make_strategy("fpl").aggregate(ups, num_classes=1, dim=2)
    assert len(result.extras["clusters"]) == 2
    # two clusters (around +x and -x) weigh equally: unbiased x ~ 0; the plain mean is 1/3
    assert abs(result.global_prototypes[0, 0]) < 0.01


def test_fpl_averages_the_clients_models_as_fedavg_does():
    # FPL's Algorithm 1: the global model is the data-size-weighted mean of the clients'.
    a = update("a", [0], [1], [[1.0, 0.0]], w=[[0.0, 4.0]])
    b = update("b", [0], [3], [[0.9, 0.1]], w=[[4.0, 0.0]])
    result = make_strategy("fpl", robust=RAW).aggregate([a, b], num_classes=1, dim=2)
    np.testing.assert_allclose(result.extras["w"], [[3.0, 1.0]])
    assert set(result.extras) == {"w", "clusters", "cluster_classes"}


def test_feddbp_fuses_each_clients_top_channels():
    a = update("a", [0], [1], [[1.0, 2.0, 3.0]], fisher=[[0.9, 0.0, 0.1]])
    b = update("b", [0], [1], [[3.0, 2.0, 1.0]], fisher=[[0.0, 0.1, 0.9]])
    result = make_strategy("feddbp", top_k=1, eta=1.0).aggregate([a, b], num_classes=1, dim=3)
    np.testing.assert_allclose(result.global_prototypes, [[2.0, 2.0, 2.0]])
    np.testing.assert_allclose(result.client_globals["a"], [[1.0, 2.0, 2.0]])
    np.testing.assert_allclose(result.client_globals["b"], [[2.0, 2.0, 1.0]])


def test_fedavg_weights_by_sample_count():
    a = update("a", [0], [1], [[0.0]], w=[[0.0, 4.0]])
    b = update("b", [0], [3], [[0.0]], w=[[4.0, 0.0]])
    result = make_strategy("fedavg", robust=RAW).aggregate([a, b], num_classes=1, dim=1)
    np.testing.assert_allclose(result.extras["w"], [[3.0, 1.0]])
    assert result.global_classes == ()


def test_solo_and_empty_rounds_aggregate_nothing():
    assert make_strategy("solo").aggregate([A, B], num_classes=3, dim=2).global_classes == ()
    for name in available():
        result = make_strategy(name).aggregate([], num_classes=3, dim=2)
        assert result.global_classes == ()
