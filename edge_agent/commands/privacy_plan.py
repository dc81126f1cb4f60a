"""``edge-agent privacy-plan``: the DP noise multipliers that spend an (epsilon, delta)
budget, chosen from public settings only."""

from __future__ import annotations

import argparse
import json
import sys

from edge_agent.privacy.accounting import plan, plan_features
from runtime.cliutil import UsageError


def cmd_privacy_plan(args: argparse.Namespace) -> int:
    try:
        if args.mechanism == "dp-features":
            chosen = plan_features(epsilon_target=args.epsilon, delta=args.delta,
                                   releases=args.releases, accountant=args.accountant)  # fmt: skip
        else:
            if args.rounds is None or args.dataset_size is None:
                raise UsageError("--mechanism dp needs --rounds and --dataset-size")
            chosen = plan(
                epsilon_target=args.epsilon,
                delta=args.delta,
                rounds=args.rounds,
                epochs=args.epochs,
                dataset_size=args.dataset_size,
                batch=args.batch,
                release_share=args.release_share,
                accountant=args.accountant,
            )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    report: dict[str, object] = {"mechanism": args.mechanism}
    if args.mechanism == "dp":
        report |= {
            "sgd_noise_multiplier": round(chosen.sgd_noise_multiplier, 4),
            "dataset_size": args.dataset_size,
            "sample_rate": chosen.sample_rate,
            "sgd_steps": chosen.sgd_steps,
        }
    report |= {
        "release_noise_multiplier": round(chosen.release_noise_multiplier, 4),
        "releases": chosen.releases,
        "epsilon": round(chosen.epsilon, 4),
        "delta": chosen.delta,
        "accountant": chosen.accountant,
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0
