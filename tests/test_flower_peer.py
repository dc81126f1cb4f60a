"""The side-by-side benchmark's shared workload, its time to accuracy, its skip without
Flower, and its Flower half (when Flower is installed: the optional ``peer`` extra)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench import flower_peer, peer_bench
from bench.flower_peer import flower_fedavg_rounds, ray_processes, wait_for_ray_to_exit
from bench.peer_accuracy import Reached, head_accuracy, time_to_target
from bench.peer_workload import Workload, load_workload, make_workload, save_workload
from bench.run import Skipped
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


def _with_test_rows(w: Workload, rows: list[int]) -> Workload:
    return Workload(features=w.features, train_index=w.train_index,
                    train_labels=w.train_labels, num_classes=w.num_classes, epochs=w.epochs,
                    batch_size=w.batch_size, seed=w.seed, test_rows=np.array(rows),
                    test_labels=np.concatenate(w.train_labels)[rows])  # fmt: skip


def test_a_saved_workload_loads_back_the_same(tmp_path) -> None:
    """The runs of the benchmark each load the workload in a process of their own."""
    made = make_workload(clients=4, per_client=7, dim=5, classes=3, seed=2, epochs=2, batch_size=4)
    w = _with_test_rows(made, [0, 3])
    save_workload(w, tmp_path / "w.npz")
    back = load_workload(tmp_path / "w.npz")
    assert np.array_equal(back.test_rows, [0, 3])
    assert np.array_equal(back.test_labels, w.test_labels)
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
    w = _with_test_rows(w, list(range(0, 80, 4)))
    run = flower_fedavg_rounds(w, rounds=2)
    assert run is not None and len(run.seconds) == len(run.weights) == 2
    assert all(math.isfinite(s) and s > 0 for s in run.seconds)
    # Each round's global model, named as the head's state dict, scores on the test rows.
    assert 0.0 <= head_accuracy(run.weights[-1], w) <= 1.0
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
    assert flower_peer.flower_fedavg_rounds(w, rounds=1) is None


def test_without_flower_the_section_says_it_skipped_and_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The section stops before building anything, with a reason naming the extra (bench/run.py
    records it in the results file), and yields no figure."""
    monkeypatch.setattr(peer_bench, "missing_modules", lambda: ["flwr", "ray"])
    monkeypatch.setattr(peer_bench, "zoo_workload", lambda: pytest.fail("built a workload"))
    with pytest.raises(Skipped, match=r"flwr, ray missing.*\[peer\]"):
        peer_bench.run()


@pytest.mark.parametrize(
    ("seconds", "accuracies", "tolerance", "expected"),
    [
        # Final 0.80, target 0.79: round 2 (0.79) is the first at it; 3 + 2 seconds.
        ([3.0, 2.0, 2.0, 2.0], [0.50, 0.79, 0.81, 0.80], 0.01, Reached(5.0, 2, 0.79, 0.80)),
        # No tolerance: the first round at or above the final's 0.80 is round 3.
        ([3.0, 2.0, 2.0, 2.0], [0.50, 0.79, 0.81, 0.80], 0.0, Reached(7.0, 3, 0.81, 0.80)),
        # Reached, lost, regained: the first time counts (round 1, at 0.70 >= 0.68).
        ([1.5, 1.0, 1.0], [0.70, 0.40, 0.69], 0.01, Reached(1.5, 1, 0.70, 0.69)),
        # Only the last round reaches it: every round's time is summed.
        ([10.0, 20.0, 30.0], [0.1, 0.2, 0.3], 0.05, Reached(60.0, 3, 0.3, 0.3)),
        # One round (lda): its time, its accuracy.
        ([15.0], [0.81], 0.01, Reached(15.0, 1, 0.81, 0.81)),
    ],
)
def test_time_to_target_sums_the_rounds_up_to_the_first_within_tolerance_of_the_last(
    seconds: list[float], accuracies: list[float], tolerance: float, expected: Reached
) -> None:
    got = time_to_target(seconds, accuracies, tolerance=tolerance)
    assert got.rounds == expected.rounds
    assert got.seconds == pytest.approx(expected.seconds)
    assert got.accuracy == pytest.approx(expected.accuracy)
    assert got.final == pytest.approx(expected.final)


@pytest.mark.parametrize(
    ("seconds", "accuracies"),
    [([], []), ([1.0], [0.5, 0.6]), ([1.0, 1.0], [0.5, float("nan")]), ([-1.0], [0.5])],
)
def test_time_to_target_refuses_what_is_not_one_scored_time_per_round(
    seconds: list[float], accuracies: list[float]
) -> None:
    with pytest.raises(ValueError):
        time_to_target(seconds, accuracies)


def test_the_section_figures_divide_flowers_time_to_its_final_accuracy_by_ldas_round() -> None:
    flower = peer_bench.Trace(seconds=(40.0, 20.0, 30.0, 25.0), accuracy=(0.3, 0.5, 0.6, 0.6))
    ours = peer_bench.Trace(seconds=(4.0, 2.0, 3.0, 2.0), accuracy=(0.3, 0.6, 0.6, 0.6))
    lda = peer_bench.Trace(seconds=(9.0,), accuracy=(0.8,))
    out = peer_bench.figures(ours=ours, lda=lda, flower=flower)
    assert out["fleet.flower_1000_fedavg_time_to_final_s"] == pytest.approx(90.0)  # rounds 1-3
    assert out["fleet.protofleet_1000_fedavg_time_to_final_s"] == pytest.approx(6.0)
    assert out["fleet.time_to_ceiling_vs_flower"] == pytest.approx(10.0)  # 90 / 9
    # The per-round figure leaves round 1 out: medians 25 and 2.
    assert out["fleet.speedup_vs_flower"] == pytest.approx(12.5)
    assert out["fleet.protofleet_1000_lda_acc"] == pytest.approx(0.8)
