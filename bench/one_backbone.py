"""The zoo's fontdigits CNN alone (192-d) and digits-5 clients' features through it: the
fleets of the vector-engine benchmarks (bench/vector_bench.py), the Flower side by side
(bench/peer_bench.py) and the closed-form figures (bench/closed_form_bench.py)."""

from __future__ import annotations

from pathlib import Path

from export import bundle as bundle_mod
from fleet.data.bundles import ensure_bundle
from fleet.data.partition import digits5
from fleet.engine.batch import FleetFeatures
from fleet.transports.spec import RunSpec
from fleet.transports.vector import features_of

ONE_BACKBONE = Path(__file__).resolve().parent / "zoo-fontdigits"


def ensure_one_backbone() -> Path:
    """The zoo's fontdigits CNN alone (192-d), built once (a few minutes)."""
    return ensure_bundle(ONE_BACKBONE, "full", backbone="zoo-fontdigits")


def pooled_features(bundle_path: Path, *, clients: int, train: int, test: int,
                    pool: int = 50) -> FleetFeatures:  # fmt: skip
    """digits-5 feature shift through the bundle's backbones: ``pool`` clients rendered
    (twice the images each client draws), ``clients`` drawn from them
    (``FleetFeatures.pooled``)."""
    spec = RunSpec(method="fedpcl", rounds=1, bundle=bundle_path, out=bundle_path,
                   transport="vector")  # fmt: skip
    base = digits5(clients=pool, split="feature", seed=0, train=2 * train, test=2 * test)
    return features_of(spec, base, bundle_mod.load(bundle_path)).pooled(
        clients=clients, train=train, test=test, seed=0
    )
