"""Closed-form heads (``make bench-closed-form``): LDA against the projection size k, against
epsilon at 5, 100 and 1,000 devices, and at 1,000 and 10,000 clients.

Every run is the real round manager and store on the vector transport, whose closed-form
clients are the agent's own ``ClosedFormDevice`` (tests/test_vector_engine.py holds them to
the memory transport's scores). Data: digits-5 feature shift through the full zoo; the 100-
and 1,000-device fleets draw their clients from 50 rendered ones (``FleetFeatures.pooled``,
as the 10,000-client benchmark does). Noise is secret, as on a device, so a private figure
is a mean over seeds 0-2. Solo (the agents' own head and linear classifier, 20 rounds) is
measured on the same clients beside each fleet.

Keys: ``closed_form.k<k>.lda_acc`` and ``.bytes_up`` (5 devices; k0 is no projection),
``closed_form.run_bytes_up_{lda,fedavg}`` (a device's uplink over a whole 30-round run at
the simulator's default k) and their ratio ``closed_form.run_bytes_fedavg_over_lda``,
``closed_form.dp<devices>.solo_acc``, ``closed_form.dp<devices>.k<k>.eps<e>.lda_acc`` (e
``inf`` for no noise), ``closed_form.lda_<clients>_{round_s, peak_mb, final_acc}``.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean
from typing import Any

import numpy as np

from bench.export_bench import ZOO, ensure_zoo
from bench.fleet_bench import median_round_s
from bench.one_backbone import ensure_one_backbone, pooled_features
from edge_agent.privacy.accounting import plan_features
from edge_agent.train_config import TrainConfig
from export import bundle as bundle_mod
from fleet.data.partition import digits5
from fleet.engine.batch import FleetFeatures
from fleet.transports.collect import round_seconds
from fleet.transports.procmem import peak_self_mb, reset_peak
from fleet.transports.spec import DEFAULT_STATS_DIM, RunSpec
from fleet.transports.vector import features_of, train_vector

SEEDS = (0, 1, 2)
KS = (64, 128, 256, 512, 0)
EPSILONS = (float("inf"), 8.0, 4.0, 1.0)
DP_KS = (64, 512)
#: (devices, training samples, test samples) per device.
FLEETS = ((5, 100, 100), (100, 50, 50), (1000, 20, 20))
SOLO_ROUNDS = 20
RUN_ROUNDS = 30
DELTA = 1e-5
_RUNS = itertools.count()


def _privacy(epsilon: float) -> dict[str, Any]:
    if epsilon == float("inf"):
        return {}
    z = plan_features(epsilon_target=epsilon, delta=DELTA).release_noise_multiplier
    return {"mechanism": "dp-features", "epsilon": epsilon, "delta": DELTA,
            "release_noise_multiplier": z}  # fmt: skip


def _fleet(devices: int, train: int, test: int, seed: int) -> FleetFeatures:
    if devices == 5:
        partition = digits5(clients=5, split="feature", seed=seed, train=train, test=test)
        spec = RunSpec(method="lda", rounds=1, bundle=ZOO, out=ZOO, transport="vector")
        return features_of(spec, partition, bundle_mod.load(ZOO))
    return pooled_features(ZOO, clients=devices, train=train, test=test)


def _run(root: Path, data: FleetFeatures, *, method: str, rounds: int, seed: int,
         stats_dim: int = 0, privacy: dict[str, Any] | None = None,
         bundle: Path = ZOO) -> tuple[float, Any]:  # fmt: skip
    """One vector run: the final mean test accuracy and its records."""
    loaded = bundle_mod.load(bundle)
    name = f"{method}-{next(_RUNS)}"  # a fresh folder: a vector run cannot resume
    spec = RunSpec(method=method, rounds=rounds, bundle=bundle, out=root / name, seed=seed,
                   transport="vector", stats_dim=stats_dim, privacy=privacy or {},
                   progress=False)  # fmt: skip
    records = train_vector(spec, data, classes=tuple(str(c) for c in range(10)),
                           bundle_id=loaded.id, feature_dim=loaded.feature_dim,
                           cfg=TrainConfig(), names=[f"client-{i:05d}" for i in range(data.clients)])  # fmt: skip
    return float(np.nanmean(records.scores["test_accuracy"][:, -1])), records


def k_sweep(root: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    fleets = {seed: _fleet(5, 100, 100, seed) for seed in SEEDS}
    for k in KS:
        runs = [_run(root, fleets[s], method="lda", rounds=2, seed=s, stats_dim=k) for s in SEEDS]
        out[f"closed_form.k{k}.lda_acc"] = mean(acc for acc, _ in runs)
        out[f"closed_form.k{k}.bytes_up"] = float(runs[0][1].bytes_up[:, 0].max())
        print(f"  closed form: k {k} done", file=sys.stderr, flush=True)
    return out


def traffic(root: Path) -> dict[str, float]:
    """A device's bytes up over a whole run of 30 rounds, lda (the simulator's default k)
    beside fedavg, 5 devices, seed 0: updates as they leave (unsigned on this transport,
    both alike)."""
    data = _fleet(5, 100, 100, 0)
    out: dict[str, float] = {}
    for method in ("lda", "fedavg"):
        _, records = _run(root, data, method=method, rounds=RUN_ROUNDS, seed=0,
                          stats_dim=DEFAULT_STATS_DIM)  # fmt: skip
        out[f"closed_form.run_bytes_up_{method}"] = float(records.bytes_up.sum(axis=1).mean())
    out["closed_form.run_bytes_fedavg_over_lda"] = (
        out["closed_form.run_bytes_up_fedavg"] / out["closed_form.run_bytes_up_lda"]
    )
    return out


def privacy_sweep(root: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for devices, train, test in FLEETS:
        fleets = {seed: _fleet(devices, train, test, seed) for seed in SEEDS}
        solo = [_run(root, fleets[s], method="solo", rounds=SOLO_ROUNDS, seed=s)[0] for s in SEEDS]
        out[f"closed_form.dp{devices}.solo_acc"] = mean(solo)
        for k in DP_KS:
            for eps in EPSILONS:
                accs = [_run(root, fleets[s], method="lda", rounds=2, seed=s, stats_dim=k,
                             privacy=_privacy(eps))[0] for s in SEEDS]  # fmt: skip
                out[f"closed_form.dp{devices}.k{k}.eps{eps:g}.lda_acc"] = mean(accs)
        print(f"  closed form: {devices} devices done", file=sys.stderr, flush=True)
    return out


def at_scale(clients: int) -> dict[str, float]:
    """LDA over ``clients`` clients (one-backbone zoo, 100 training and 20 test samples
    each, 3 rounds), measured in a child process so its peak is its own."""
    done = subprocess.run([sys.executable, "-m", "bench.closed_form_bench", "scale", str(clients)],
                          stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {f"closed_form.lda_{clients}_{k}": float(v) for k, v in result.items()}


def run() -> dict[str, float]:
    ensure_zoo()
    ensure_one_backbone()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="protofleet-closed-form-") as tmp:
        out |= k_sweep(Path(tmp))
        out |= traffic(Path(tmp))
        out |= privacy_sweep(Path(tmp))
    for clients in (1000, 10_000):
        out |= at_scale(clients)
    return out


def _child(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "scale":
        print("usage: python -m bench.closed_form_bench scale CLIENTS", file=sys.stderr)
        return 2
    clients = int(argv[1])
    bundle = ensure_one_backbone()
    reset_peak()
    data = pooled_features(bundle, clients=clients, train=100, test=20)
    with tempfile.TemporaryDirectory(prefix="protofleet-lda-scale-") as tmp:
        acc, _ = _run(Path(tmp), data, method="lda", rounds=3, seed=0, bundle=bundle)
        spec_out = next(Path(tmp).iterdir())
        seconds = round_seconds(RunSpec(method="lda", rounds=3, bundle=bundle, out=spec_out))
    print(json.dumps({"round_s": median_round_s(seconds, after_first=True),
                      "first_round_s": seconds[0], "peak_mb": peak_self_mb(),
                      "final_acc": acc}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
