"""Privacy benchmarks: DP FedPCL at epsilon 8 against non-private Solo on digits-5 feature
shift (same partition, same run), and the canary audit's empirical epsilon next to the
claimed one (and next to a deliberately broken mechanism's). Solo has the agents' own
linear classifier, as under the fair protocol of ``edge-fleet privacy``: what a device
keeps by not federating."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.export_bench import ZOO, ensure_zoo
from edge_agent.privacy.accounting import plan
from edge_agent.privacy.audit import canary_audit, release_broken
from fleet import runner
from fleet.partition import digits5
from fleet.report import run_summary

ROUNDS = 20


def _final(root: Path, method: str, privacy: dict[str, object], train: dict[str, object]) -> float:
    partition = digits5(clients=5, split="feature", seed=0, train=100, test=100)
    spec = runner.RunSpec(method=method, rounds=ROUNDS, bundle=ZOO, out=root / method,
                          transport="memory", privacy=privacy, extra_train=train)  # fmt: skip
    return float(run_summary(runner.run(spec, partition))["final_mean"])


def run() -> dict[str, float]:
    ensure_zoo()
    chosen = plan(epsilon_target=8.0, delta=1e-5, rounds=ROUNDS, epochs=1, samples=100, batch=32)
    dp = {"mechanism": "dp", "epsilon": 8.0, "delta": 1e-5,
          "sgd_noise_multiplier": chosen.sgd_noise_multiplier,
          "release_noise_multiplier": chosen.release_noise_multiplier}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="protofleet-privacy-bench-") as tmp:
        solo = _final(Path(tmp), "solo", {}, {})
        private = _final(Path(tmp), "fedpcl", dp, {"norm": "group"})
    real = canary_audit(runs=20_000)
    broken = canary_audit(runs=20_000, mechanism=release_broken)
    return {
        "privacy.fedpcl_eps8_minus_solo": 100 * (private - solo),
        "privacy.fedpcl_eps8_acc": private,
        "privacy.solo_acc": solo,
        "privacy.audit_eps_lower_bound": real.epsilon_lower_bound,
        "privacy.audit_eps_claimed": real.epsilon_claimed,
        "privacy.audit_broken_eps_lower_bound": broken.epsilon_lower_bound,
    }
