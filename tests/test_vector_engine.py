"""The vector engine against the agent: the same fleet run through ``Agent`` objects
(--transport memory) and as one batched computation (--transport vector) gives every
client the same scores, round after round; its pieces against the agent's own; and the
coordinator's store and round manager as a vector run drives them."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import StateError, Store
from edge_agent.train import Guidance, LocalModel, make_optimiser, train_round
from edge_agent.train_config import TrainConfig
from fleet.cli.commands import cmd_run
from fleet.cli.main import build_parser
from fleet.data import partition as part
from fleet.engine.batch import VECTOR_METHODS, FleetFeatures, VectorEngine
from fleet.engine.heads import HeadStack, Rows
from fleet.transports import runner
from fleet.transports.spec import RunSpec
from fleet.transports.vector_coordinator import VectorRoundManager, VectorStore
from runtime.cliutil import UsageError
from tests.coordinator_helpers import config, stand_in_update


def _scores(result: runner.RunResult) -> list[tuple[float | None, ...]]:
    return [c.accuracy + c.accuracy_prototype + c.accuracy_classifier for c in result.clients]


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, abs_tol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", VECTOR_METHODS)
def test_the_vector_engine_scores_every_client_as_its_agent_does(
    method: str, small_zoo: Path, tmp_path: Path
) -> None:
    # Two sizes of training set: the engine's ragged path (clients grouped by size) too.
    partition = part.digits5(clients=8, split="feature", seed=4, train=40, test=30)
    short = part.ClientData(**{**partition.clients[1].__dict__,
                               "train_x": partition.clients[1].train_x[:33],
                               "train_y": partition.clients[1].train_y[:33]})  # fmt: skip
    clients = list(partition.clients)
    clients[1] = short
    partition = part.Partition(tuple(clients), partition.classes, partition.description)
    results = {}
    for transport in ("memory", "vector"):
        spec = RunSpec(method=method, rounds=3, bundle=small_zoo, out=tmp_path / transport,
                       transport=transport, out_dim=32, progress=False)  # fmt: skip
        results[transport] = runner.run(spec, partition)
    memory, vector = (_scores(results[t]) for t in ("memory", "vector"))
    assert any(v is not None for row in vector for v in row)
    for m_row, v_row in zip(memory, vector, strict=True):
        assert all(_close(a, b) for a, b in zip(m_row, v_row, strict=True)), (m_row, v_row)
    # The same updates, but unsigned: each smaller by one signature envelope's size.
    overheads = {
        mu - vu
        for m, v in zip(results["memory"].clients, results["vector"].clients, strict=True)
        for mu, vu in zip(m.bytes_up, v.bytes_up, strict=True)
    }
    assert len(overheads) == 1 and 0 < overheads.pop() < 200
    assert all(d > 0 for c in results["vector"].clients for d in c.bytes_down)


@pytest.fixture
def one_torch_thread():
    """The agent's side on one torch thread, as each of the engine's chunks and each agent
    of a simulated fleet computes: a product split over two threads rounds otherwise. (The
    test passed before only when an earlier in-process memory fleet had left the whole
    session on one thread; the memory transport now gives the caller's count back.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_group_step_equals_the_agents_step_weight_for_weight() -> None:
    """Three clients, one of them ragged, two rounds of FedPCL and FedProto against announced
    sets, and of FedPCL, Solo and FedAvg with nothing announced: the stack's weights after
    training match each agent's LocalModel: FedPCL's bit for bit, the others' to 1e-5."""
    rng = np.random.default_rng(0)
    cfg = TrainConfig(out_dim=32, batch_size=8)
    num_classes, dim = 3, 96
    sizes = [20, 20, 13]
    features = rng.normal(size=(sum(sizes), dim)).astype(np.float32)
    starts = np.cumsum([0, *sizes])
    train_index = tuple(np.arange(a, b) for a, b in itertools.pairwise(starts))
    labels = tuple(rng.integers(0, num_classes, size=n) for n in sizes)
    data = FleetFeatures(features=features, train_index=train_index, train_labels=labels,
                         test_index=train_index, test_labels=labels)  # fmt: skip
    protos = torch.nn.functional.normalize(torch.randn(num_classes, cfg.out_dim), dim=1)
    announced = Guidance(global_protos=protos, global_present=torch.tensor([True, True, False]),
                        local_sets=protos[None].repeat(2, 1, 1) * 0.5,
                        local_present=torch.ones(2, num_classes, dtype=torch.bool))  # fmt: skip
    empty = Guidance.empty(num_classes, cfg.out_dim)  # round 0: nothing announced yet
    for method, guidance in (("fedpcl", announced), ("fedproto", announced),
                             ("fedpcl", empty), ("solo", empty), ("fedavg", empty)):  # fmt: skip
        seeds = [11, 12, 13]
        engine = VectorEngine(data=data, method=method, num_classes=num_classes, cfg=cfg,
                              seeds=seeds, init_seeds=seeds)  # fmt: skip
        for _ in range(2):
            list(engine.train_round(guidance))
        for k, seed in enumerate(seeds):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                model = LocalModel(in_dim=dim, num_classes=num_classes, cfg=cfg)
            optimiser = make_optimiser(model, cfg)
            generator = torch.Generator().manual_seed(seed)
            for _ in range(2):
                train_round(model, optimiser, features[train_index[k]], labels[k], method=method,
                            guidance=guidance, cfg=cfg, generator=generator)  # fmt: skip
            stacked = engine.stack.state_of(k)
            for key, value in model.state_dict().items():
                if key.startswith("classifier") and method == "fedpcl":
                    continue
                # FedPCL's weights are the agent's to the bit; a classifier's weight gradient
                # (one batched product, fleet/engine/heads.py::_Linear) leaves the others
                # within a float32 ulp or so.
                same = (
                    torch.equal(stacked[key].to(value.dtype), value)
                    if method == "fedpcl"
                    else torch.allclose(stacked[key].to(value.dtype), value, atol=1e-5)
                )
                assert same, (
                    method,
                    k,
                    key,
                )


@pytest.mark.parametrize("method", ["fedpcl", "fedavg"])
def test_chunks_trained_side_by_side_equal_chunks_trained_in_turn(method: str) -> None:
    """Seven clients in chunks of two (one ragged chunk of one), two rounds: trained two
    chunks at a time on one core each, every client's weights, Adam moments, BatchNorm
    statistics and released prototypes are those of the chunks trained one after
    another, to the bit, and come back in client order."""
    rng = np.random.default_rng(1)
    cfg = TrainConfig(out_dim=16, batch_size=8)
    sizes = [12, 12, 12, 12, 9, 9, 12]
    features = rng.normal(size=(sum(sizes), 24)).astype(np.float32)
    starts = np.cumsum([0, *sizes])
    index = tuple(np.arange(a, b) for a, b in itertools.pairwise(starts))
    labels = tuple(rng.integers(0, 3, size=n) for n in sizes)
    data = FleetFeatures(features=features, train_index=index, train_labels=labels,
                         test_index=index, test_labels=labels)  # fmt: skip
    protos = torch.nn.functional.normalize(torch.randn(3, cfg.out_dim), dim=1)
    announced = Guidance(global_protos=protos, global_present=torch.ones(3, dtype=torch.bool),
                         local_sets=protos[None].repeat(2, 1, 1) * 0.5,
                         local_present=torch.ones(2, 3, dtype=torch.bool))  # fmt: skip
    guidance = announced if method == "fedpcl" else Guidance.empty(3, cfg.out_dim)
    runs = []
    for threads in (1, 2):
        seeds = list(range(20, 27))
        engine = VectorEngine(data=data, method=method, num_classes=3, cfg=cfg, seeds=seeds,
                              init_seeds=seeds, chunk=2, threads=threads)  # fmt: skip
        rounds = [list(engine.train_round(guidance)) for _ in range(2)]
        runs.append((engine, rounds))
    (one, rounds_one), (two, rounds_two) = runs
    for a, b in zip(rounds_one, rounds_two, strict=True):
        assert [k for k, _ in a] == [k for k, _ in b] == list(range(7))
        for (_, ra), (_, rb) in zip(a, b, strict=True):
            assert np.array_equal(ra.release_protos, rb.release_protos)
            assert np.array_equal(ra.release_counts, rb.release_counts)
            assert ra.weights.keys() == rb.weights.keys()
            assert all(np.array_equal(ra.weights[n], rb.weights[n]) for n in ra.weights)
    for name in one.stack.params:
        assert torch.equal(one.stack.params[name], two.stack.params[name]), name
        assert torch.equal(one.stack.m[name], two.stack.m[name]), name
        assert torch.equal(one.stack.v[name], two.stack.v[name]), name
    assert torch.equal(one.stack.running_mean, two.stack.running_mean)
    assert torch.equal(one.stack.running_var, two.stack.running_var)
    assert torch.equal(one.stack.steps, two.stack.steps)
    assert not torch.equal(one.stack.params["w"][0], one.stack.params["w"][1])


def test_the_stack_round_trips_a_models_state() -> None:
    cfg = TrainConfig(out_dim=4)
    stack = HeadStack.initial(seeds=[3, 4], in_dim=5, num_classes=2, cfg=cfg, method="solo")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        model = LocalModel(in_dim=5, num_classes=2, cfg=cfg)
    for key, value in model.state_dict().items():
        assert torch.equal(stack.state_of(1)[key], value), key
    assert not torch.equal(stack.state_of(0)["head.fc.weight"], model.head.fc.weight_t.t())
    assert Rows(0, 2).take(stack.params["b"]).shape == (2, 4)
    # Every entry, BatchNorm statistics included, goes in and comes back as it was.
    generator = torch.Generator().manual_seed(7)
    state = {
        k: torch.rand(v.shape, generator=generator) if v.is_floating_point() else v
        for k, v in model.state_dict().items()
    }
    stack.load(1, state)
    back = stack.state_of(1)
    for key, value in state.items():
        if value.is_floating_point():
            assert torch.equal(back[key], value), key
    assert torch.equal(
        stack.state_of(0)["head.fc.weight"],
        HeadStack.initial(seeds=[3], in_dim=5, num_classes=2, cfg=cfg, method="solo").state_of(0)[
            "head.fc.weight"
        ],
    )


def test_methods_the_engine_lacks_are_refused_with_a_reason(
    small_zoo: Path, tmp_path: Path
) -> None:
    partition = part.digits5(clients=2, split="feature", seed=0, train=8, test=4)
    spec = RunSpec(method="feddbp", rounds=1, bundle=small_zoo, out=tmp_path / "x",
                   transport="vector", out_dim=8, progress=False)  # fmt: skip
    with pytest.raises(UsageError, match="--transport memory or mqtt"):
        runner.run(spec, partition)


@pytest.mark.slow
def test_edge_fleet_run_on_the_vector_transport_writes_its_report(
    small_zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["run", "--transport", "vector", "--method", "fedpcl", "--bundle", str(small_zoo),
            "--rounds", "2", "--clients", "3", "--train", "20", "--test", "10",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert cmd_run(build_parser().parse_args(argv)) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["backbone_contribution"] is None  # no device state to read it from
    assert 0.0 <= report["methods"]["fedpcl"]["final_mean"] <= 1.0
    assert not (out / "backbone_contribution.png").exists()
    assert "report.json" in capsys.readouterr().out


def _vector_manager(
    state_dir: Path, *, min_clients: int, wait_after_quorum_s: float = 5.0
) -> VectorRoundManager:
    cfg = config(state_dir, min_clients=min_clients, wait_after_quorum_s=wait_after_quorum_s)
    store = VectorStore(cfg.database, synchronous=cfg.sqlite_synchronous)
    return VectorRoundManager(config=cfg, store=store, metrics=Metrics())


def test_the_vector_coordinator_closes_rounds_as_the_service_and_refuses_to_resume(
    tmp_path: Path,
) -> None:
    """The vector run's store keeps each update's row and tally, not its payload; the
    round closes on what the manager decoded on arrival, to the globals the service's
    store and manager give. Reopening it mid-round is refused (nothing to aggregate
    from), reading a payload says why, and the service refuses its database."""
    ups = [stand_in_update(i, 0) for i in range(3)]
    cfg = config(tmp_path / "full", min_clients=3, wait_after_quorum_s=0.0)
    full = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics())
    bare = _vector_manager(tmp_path / "bare", min_clients=3, wait_after_quorum_s=0.0)
    for m in (full, bare):
        for u in ups:
            assert m.offer(u.to_wire(), topic_client=u.client).accepted
    assert bare.store.update_clients(0) == ["dev-0", "dev-1", "dev-2"]
    tallies = [
        {c["client"]: c["updates_accepted"] for c in m.store.summary()["clients"]}
        for m in (full, bare)
    ]
    assert tallies[0] == tallies[1] == {"dev-0": 1, "dev-1": 1, "dev-2": 1}
    with pytest.raises(StateError, match="without its payload"):
        bare.store.update_payload(0, "dev-1")
    a, b = full.poll(), bare.poll()
    assert a is not None and b is not None
    assert a.global_classes == b.global_classes
    assert np.array_equal(a.global_prototypes, b.global_prototypes)
    assert a.local_sets.keys() == b.local_sets.keys()

    half = _vector_manager(tmp_path / "half", min_clients=3)
    half.offer(ups[0].to_wire())
    half.store.close()
    with pytest.raises(StateError, match="cannot be resumed"):
        _vector_manager(tmp_path / "half", min_clients=3)
    served = config(tmp_path / "half", min_clients=3)
    with pytest.raises(StateError, match="payloads"):
        RoundManager(config=served, store=Store(served.database), metrics=Metrics())


def test_the_vector_coordinator_computes_no_receipt_digest(tmp_path: Path) -> None:
    # No device awaits a receipt; the service's manager names one (test_coordinator_rounds.py).
    m = _vector_manager(tmp_path, min_clients=5)
    u0 = stand_in_update(0, 0)
    first = m.offer(u0.to_wire())
    assert first.accepted and first.digest is None
    again = m.offer(u0.to_wire())
    assert again.reason == "duplicate" and again.digest is None
