"""The side-by-side benchmark's shared workload, and its Flower half (when Flower is
installed: the optional ``peer`` extra)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench import flower_peer
from bench.flower_peer import flower_fedavg_round_seconds, ray_processes, wait_for_ray_to_exit
from bench.peer_workload import Workload, load_workload, make_workload, save_workload
from edge_agent.train import Guidance, LocalModel, embed, make_optimiser, train_round
from edge_agent.train_config import TrainConfig


def test_the_workload_is_the_same_for_a_seed_and_differs_across_seeds() -> None:
    a, b = (make_workload(clients=5, per_client=12, dim=8, classes=3, seed=7) for _ in range(2))
    other = make_workload(clients=5, per_client=12, dim=8, classes=3, seed=8)
    assert a.features.shape == (60, 8) and a.features.dtype == np.float32
    assert np.array_equal(a.features, b.features)
    assert all(np.array_equal(x, y) for x, y in zip(a.train_index, b.train_index, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(a.train_labels, b.train_labels, strict=True))
    assert not np.array_equal(a.features, other.features)
    # Every row belongs to exactly one client.
    assert sorted(np.concatenate(a.train_index).tolist()) == list(range(60))


def test_a_saved_workload_loads_back_the_same(tmp_path) -> None:
    """The two halves of the benchmark each load the workload in a process of their own."""
    w = make_workload(clients=4, per_client=7, dim=5, classes=3, seed=2, epochs=2, batch_size=4)
    save_workload(w, tmp_path / "w.npz")
    back = load_workload(tmp_path / "w.npz")
    assert np.array_equal(back.features, w.features) and back.features.dtype == np.float32
    for a, b in ((back.train_index, w.train_index), (back.train_labels, w.train_labels)):
        assert len(a) == len(b) == 4
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert (back.num_classes, back.epochs, back.batch_size, back.seed) == (3, 2, 4, 2)


def test_the_workload_refuses_a_label_outside_its_classes() -> None:
    w = make_workload(clients=2, per_client=4, dim=3, classes=2, seed=0)
    with pytest.raises(ValueError, match="label"):
        Workload(
            features=w.features,
            train_index=w.train_index,
            train_labels=(w.train_labels[0], w.train_labels[1] + 2),
            num_classes=2,
            epochs=1,
            batch_size=32,
            seed=0,
        )


def test_the_head_learns_one_client_and_carries_over_to_another() -> None:
    w = make_workload(clients=2, per_client=100, dim=16, classes=4, seed=3)
    cfg = TrainConfig(epochs=50, batch_size=32, out_dim=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LocalModel(in_dim=w.dim, num_classes=w.num_classes, cfg=cfg)
    features, labels = w.client_data(0)
    train_round(
        model,
        make_optimiser(model, cfg),
        features,
        labels,
        method="fedavg",
        guidance=Guidance.empty(w.num_classes, cfg.out_dim),
        cfg=cfg,
        generator=torch.Generator().manual_seed(0),
    )

    def accuracy(client: int) -> float:
        features, truth = w.client_data(client)
        return float((embed(model, features)[1].argmax(axis=1) == truth).mean())

    # Chance is 0.25; the other client's samples carry another shift.
    assert accuracy(0) > 0.9
    assert accuracy(1) > 0.7


@pytest.mark.slow
def test_flower_runs_the_workload_and_times_its_rounds() -> None:
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    w = make_workload(clients=4, per_client=20, dim=16, classes=3, seed=0)
    seconds = flower_fedavg_round_seconds(w, rounds=2)
    assert seconds is not None and math.isfinite(seconds) and seconds > 0
    # Flower returned with its actors still exiting; the benchmark waited for them.
    assert ray_processes() == []


def test_the_wait_for_ray_sees_a_process_of_this_group_named_as_rays_until_it_ends() -> None:
    """A child renamed ``ray::probe`` (as Ray names its actors) is found, and the wait
    returns once it has ended, not before."""
    code = (
        "import sys; open('/proc/self/comm', 'w').write('ray::probe'); "
        "print('named', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "named\n"
        assert child.pid in ray_processes()
    finally:
        assert child.stdin is not None
        child.stdin.close()  # the child's read returns and it exits
    wait_for_ray_to_exit(timeout_s=30)
    assert child.pid not in ray_processes()
    assert child.wait(timeout=30) == 0


def test_without_flower_the_figure_is_none_not_an_import_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("flwr", "ray") else real(name, *a),
    )
    w = make_workload(clients=2, per_client=4, dim=3, classes=2, seed=0)
    assert flower_peer.flower_fedavg_round_seconds(w, rounds=1) is None
