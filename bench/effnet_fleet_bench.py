"""ImageNet features against the glyph zoo in the fleet: FedPCL, Solo and FedAvg on
digits-5 feature shift (5 devices, one domain each, 100 training and 100 test images per
device, 30 rounds, seeds 0-2), as `edge-fleet compare` runs them by default (the fair
protocol: the linear classifier wherever a method has one), once on the glyph zoo and once on EfficientNet-Lite0 (fp32,
the 32x32 digits resized to 224). Same partitions, same machine, one run.

Each bundle's sweep shares one feature cache: the backbones see each image once, whatever
the method. ``fleet.<bundle>_feature_first_run_s`` is the mean time of each seed's first
run, the one that fills the cache (at 224 for EfficientNet-Lite0).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from statistics import mean

from bench.export_bench import ensure_zoo
from fleet.data.bundles import ensure_bundle
from fleet.data.partition import digits5
from fleet.report.summary import run_summary
from fleet.transports import runner
from fleet.transports.protocols import protocol_train
from fleet.transports.spec import RunSpec
from protocol.methods import WIRE_METHODS

EFFNET = Path(__file__).resolve().parent / "effnet-lite0"
#: FedPCL, the core method, and the baselines of its records (protocol/methods.py).
CORE = "fedpcl"
METHODS = (CORE, *(m.name for m in WIRE_METHODS.values() if m.baseline))
SEEDS = (0, 1, 2)
ROUNDS = 30


def _sweep(root: Path, bundle: Path) -> tuple[dict[str, float], float]:
    """Mean over seeds of each method's final mean accuracy, and the mean seconds of each
    seed's first run (the one that fills the feature cache)."""
    finals: dict[str, list[float]] = {m: [] for m in METHODS}
    first_runs = []
    for seed in SEEDS:
        partition = digits5(clients=5, split="feature", seed=seed, train=100, test=100)
        for method in METHODS:
            spec = RunSpec(method=method, rounds=ROUNDS, bundle=bundle, seed=seed,
                                  out=root / f"{method}-{seed}", transport="memory",
                                  extra_train=dict(protocol_train("fair", method)),
                                  feature_cache=root / "feature-cache", progress=False)  # fmt: skip
            start = time.perf_counter()
            finals[method].append(float(run_summary(runner.run(spec, partition))["final_mean"]))
            if method == METHODS[0]:
                first_runs.append(time.perf_counter() - start)
    return {m: mean(v) for m, v in finals.items()}, mean(first_runs)


def run() -> dict[str, float]:
    zoo = ensure_zoo()
    effnet = ensure_bundle(EFFNET, "full", backbone="effnet-lite0")
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="protofleet-effnet-fleet-") as tmp:
        root = Path(tmp)
        for name, bundle in (("zoo", zoo), ("effnet", effnet)):
            finals, first = _sweep(root / name, bundle)
            for method, value in finals.items():
                out[f"fleet.{name}_feature_{method}_mean"] = value
            out[f"fleet.{name}_feature_first_run_s"] = first
    for method in METHODS:
        out[f"fleet.effnet_minus_zoo_{method}_points"] = 100 * (
            out[f"fleet.effnet_feature_{method}_mean"] - out[f"fleet.zoo_feature_{method}_mean"]
        )
    return out
