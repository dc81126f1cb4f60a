"""ProtoFleet next to Flower's simulation engine on one workload, in one run (``make
bench``, the ``peer`` extra installed: ``pip install -e '.[peer]'``).

The workload: 1,000 clients of 100 training samples, each training the same head and
linear classifier on the same cached features (digits-5 through the zoo's 192-d digit
backbone) for the same epoch, FedAvg every round (bench/peer_workload.py), and a
held-out test set of 20 samples per client (20,000 rows, drawn from test images no client
trains on). Three runs, each in a fresh process of its own, one after the other:

- the vector engine's FedAvg, :data:`FEDAVG_ROUNDS` rounds, against the coordinator's
  round manager and store;
- lda's one round on the vector engine (the closed-form head: each client's statistics
  up once, the coordinator's solve, at the simulator's default k);
- Flower's FedAvg, :data:`FEDAVG_ROUNDS` rounds (its fastest setting found here,
  bench/flower_peer.py).

Accuracy, the same for all three (bench/peer_accuracy.py): the global model each round
ends with (FedAvg's averaged model; lda's fleet head as announced, before any device
personalises it), top-1 over the 20,000 test rows, scored after the run, so no round's
time holds any scoring. A round's time: Flower's from its strategy's configure_fit to
the end of aggregate_fit; the vector engine's from the coordinator's announcement to the
round's close. Setting up before round 1 (Ray and its actors' start, the store) counts
for neither; what round 1 itself spends starting up counts in time to accuracy.

Time to accuracy: a run's *final accuracy* is that of its last round; it *reaches* it at
the end of the first round whose accuracy is at least the final less :data:`TOLERANCE`
(one point), and its time to it is the sum of the times of rounds 1 up to that one.
lda's final round is its only one.

:data:`FEDAVG_ROUNDS` is 100, enough for FedAvg to come near its ceiling here: the vector
engine's FedAvg on this workload scored 65.6 at round 40, 69.6 at 80, 71.1 at 100 and
71.6-71.9 over rounds 105-120 (one run of 120 rounds, 2026-11-28), gaining about 0.14
point a round at round 40 and 0.05 at round 100. Fewer rounds would set a lower final
accuracy, which FedAvg reaches sooner: the ratio would understate FedAvg's time to its
ceiling (40 rounds gave 168 on 2026-11-28, commit e606d747562d). A Flower round took
17.3 s on the 2-core development machine with little else running (median of rounds 2-40,
2026-11-28), 24-33 s with other work (bench/flower_peer.py), so Flower's 100 rounds take
30-55 minutes. Each run's accuracies, round by round, go to the section's log: in the
100-round run of 2026-11-28 (commit 6ef2d08bec17) Flower's FedAvg was still gaining
about 0.05 point a round at round 100 (70.1 at 71, 72.3 at 100), so its ceiling here
lies a little above the final accuracy it is timed to.

Keys (``fleet.``): ``time_to_ceiling_vs_flower`` = Flower's time to its final accuracy
over lda's (its one round); ``flower_1000_fedavg_*`` and ``protofleet_1000_fedavg_*``:
``final_acc``, ``time_to_final_s``, ``rounds_to_final``; ``protofleet_1000_lda_acc``,
``protofleet_1000_lda_s``; and, as before, ``flower_1000_round_s``,
``protofleet_1000_fedavg_round_s`` (each the median of rounds 2 on, round 1's start-up
left out) and their ratio ``speedup_vs_flower``. Without Flower the section raises
:class:`bench.run.Skipped` with the reason: no figure is left out unexplained or filled
from an earlier run.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.fleet_bench import median_round_s
from bench.flower_peer import flower_fedavg_rounds, missing_modules
from bench.one_backbone import ensure_one_backbone, pooled_features
from bench.peer_accuracy import TOLERANCE, closed_form_accuracy, head_accuracy, time_to_target
from bench.peer_workload import Workload, load_workload, save_workload
from bench.run import Skipped
from edge_agent.train_config import TrainConfig
from fleet.engine.batch import FleetFeatures
from fleet.transports.collect import round_seconds
from fleet.transports.configs import prototype_dim
from fleet.transports.spec import FLEET, RunSpec
from fleet.transports.vector import train_vector
from protocol import RoundAnnouncement

#: The workload: clients, training and held-out test samples per client.
CLIENTS, PER_CLIENT, TEST_PER_CLIENT = 1000, 100, 20
#: FedAvg rounds of Flower and of the vector engine (the module's text says why 100).
FEDAVG_ROUNDS = 100


@dataclass(frozen=True)
class Trace:
    """One run: each round's seconds and the accuracy of the model it ended with."""

    seconds: tuple[float, ...]
    accuracy: tuple[float, ...]

    def to_json(self) -> str:
        return json.dumps({"seconds": list(self.seconds), "accuracy": list(self.accuracy)})

    @classmethod
    def from_json(cls, text: str) -> Trace:
        d = json.loads(text)
        return cls(seconds=tuple(map(float, d["seconds"])),
                   accuracy=tuple(map(float, d["accuracy"])))  # fmt: skip


def zoo_workload() -> Workload:
    """The cached features of 1,000 digits-5 clients (pooled from 50 rendered ones) and
    every client's test rows, pooled into one held-out test set."""
    data = pooled_features(ensure_one_backbone(), clients=CLIENTS, train=PER_CLIENT,
                           test=TEST_PER_CLIENT)  # fmt: skip
    return Workload(features=data.features, train_index=data.train_index,
                    train_labels=data.train_labels, num_classes=10, epochs=1, batch_size=32,
                    seed=0, test_rows=np.concatenate(data.test_index).astype(np.int64),
                    test_labels=np.concatenate(data.test_labels).astype(np.int64))  # fmt: skip


def vector_run(
    workload: Workload, *, method: str, rounds: int, root: Path
) -> tuple[tuple[float, ...], dict[int, RoundAnnouncement]]:
    """``rounds`` rounds of ``method`` on the vector engine, against the coordinator's
    round manager and store: each round's seconds, and each announcement by round (round
    r's carries what round r - 1 ended with)."""
    index = tuple(workload.train_index)
    labels = tuple(workload.train_labels)
    data = FleetFeatures(features=workload.features, train_index=index, train_labels=labels,
                         test_index=index, test_labels=labels)  # fmt: skip
    spec = RunSpec(method=method, rounds=rounds, bundle=root, out=root / method,
                   transport="vector", epochs=workload.epochs, progress=False)  # fmt: skip
    announced: dict[int, RoundAnnouncement] = {}
    # FedAvg's clients start from one head, as Flower's from the server's parameters; and
    # like Flower's (no evaluation rounds) they train and send, without scoring a test
    # set: the announced models are kept (a reference each) and scored after the run.
    train_vector(spec, data, classes=tuple(str(c) for c in range(workload.num_classes)),
                 bundle_id=hashlib.sha256(b"peer-workload").hexdigest(),
                 feature_dim=workload.dim,
                 cfg=TrainConfig(epochs=workload.epochs, batch_size=workload.batch_size),
                 names=[f"client-{i:05d}" for i in range(data.clients)],
                 seeds=([workload.seed + i for i in range(data.clients)],
                        [workload.seed] * data.clients),
                 evaluate=False,
                 observe=lambda a: announced.__setitem__(a.round, a))  # fmt: skip
    return round_seconds(spec), announced


def protofleet_fedavg(workload: Workload, *, rounds: int, root: Path) -> Trace:
    seconds, announced = vector_run(workload, method="fedavg", rounds=rounds, root=root)
    accuracy = [head_accuracy(announced[r + 1].extras, workload) for r in range(rounds)]
    return Trace(seconds=seconds, accuracy=tuple(accuracy))


def protofleet_lda(workload: Workload, *, root: Path) -> Trace:
    seconds, announced = vector_run(workload, method="lda", rounds=1, root=root)
    dim = prototype_dim(RunSpec(method="lda", rounds=1, bundle=root, out=root), workload.dim)
    return Trace(seconds=seconds,
                 accuracy=(closed_form_accuracy(announced[1], workload, fleet=FLEET, dim=dim),))  # fmt: skip


def flower_fedavg(workload: Workload, *, rounds: int) -> Trace:
    run = flower_fedavg_rounds(workload, rounds=rounds)
    if run is None:
        raise Skipped(_not_installed())
    return Trace(
        seconds=run.seconds, accuracy=tuple(head_accuracy(w, workload) for w in run.weights)
    )


def figures(*, ours: Trace, lda: Trace, flower: Trace) -> dict[str, float]:
    """The section's keys from its three runs."""
    out: dict[str, float] = {}
    reached = {}
    for name, trace in (("flower_1000_fedavg", flower), ("protofleet_1000_fedavg", ours)):
        r = reached[name] = time_to_target(trace.seconds, trace.accuracy, tolerance=TOLERANCE)
        out |= {f"fleet.{name}_final_acc": r.final, f"fleet.{name}_time_to_final_s": r.seconds,
                f"fleet.{name}_rounds_to_final": float(r.rounds)}  # fmt: skip
    one = time_to_target(lda.seconds, lda.accuracy, tolerance=TOLERANCE)
    flower_round = median_round_s(list(flower.seconds), after_first=True)
    our_round = median_round_s(list(ours.seconds), after_first=True)
    return out | {
        "fleet.protofleet_1000_lda_acc": one.final,
        "fleet.protofleet_1000_lda_s": one.seconds,
        "fleet.time_to_ceiling_vs_flower": reached["flower_1000_fedavg"].seconds / one.seconds,
        "fleet.flower_1000_round_s": flower_round,
        "fleet.protofleet_1000_fedavg_round_s": our_round,
        "fleet.speedup_vs_flower": flower_round / our_round,
    }


def _not_installed() -> str:
    return (f"Flower's simulation engine is not installed ({', '.join(missing_modules())} "
            "missing): pip install -e '.[peer]' (make bench-peer)")  # fmt: skip


def run() -> dict[str, float]:
    """Each run in a fresh process of its own, ProtoFleet's two then Flower's, on the one
    workload built here: none runs beside what another left (Flower returns while its
    actors are still exiting; a process that ran anything keeps its heap)."""
    if missing_modules():
        raise Skipped(_not_installed())
    with tempfile.TemporaryDirectory(prefix="protofleet-peer-") as tmp:
        saved = Path(tmp) / "workload.npz"
        save_workload(zoo_workload(), saved)
        traces = {run: _half(run, saved) for run in RUNS}
    return figures(ours=traces["protofleet"], lda=traces["protofleet-lda"],
                   flower=traces["flower"])  # fmt: skip


#: The child runs: the vector engine's FedAvg, its one round of lda, Flower's FedAvg.
RUNS = ("protofleet", "protofleet-lda", "flower")


def _half(name: str, saved: Path) -> Trace:
    """One run's trace, measured by a child process (``_child``)."""
    print(f"  peer: {name} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "bench.peer_bench", name, str(saved)],
                          stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
    trace = Trace.from_json(done.stdout.strip().splitlines()[-1])
    # The curve behind the figures, for judging whether FedAvg had levelled off.
    print(f"  peer: {name}: accuracy by round {[round(a, 4) for a in trace.accuracy]}, "
          f"{sum(trace.seconds):.1f} s in all", file=sys.stderr, flush=True)  # fmt: skip
    return trace


def _child(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in RUNS:
        print(f"usage: python -m bench.peer_bench {{{','.join(RUNS)}}} WORKLOAD.npz",
              file=sys.stderr)  # fmt: skip
        return 2
    workload = load_workload(Path(argv[1]))
    if argv[0] == "flower":
        try:
            trace = flower_fedavg(workload, rounds=FEDAVG_ROUNDS)
        except Skipped as why:
            print(why, file=sys.stderr)
            return 1
    else:
        with tempfile.TemporaryDirectory(prefix="protofleet-peer-") as tmp:
            if argv[0] == RUNS[1]:
                trace = protofleet_lda(workload, root=Path(tmp))
            else:
                trace = protofleet_fedavg(workload, rounds=FEDAVG_ROUNDS, root=Path(tmp))
    print(trace.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
