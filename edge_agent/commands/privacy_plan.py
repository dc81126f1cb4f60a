"""``edge-agent privacy-plan``: the DP noise multipliers that spend an (epsilon, delta)
budget, chosen from public settings only."""

from __future__ import annotations

import argparse
import json
import sys

from edge_agent.privacy.accounting import plan, plan_features
from runtime.cliutil import UsageError
from secagg.dimension import BASIS_RATIO, RATIO, noise_ratio, public_dim, sum_sigma
from secagg.fleet import SecureAggregation

#: The quantiser's step a fleet's table takes unless it sets one.
SCALE = SecureAggregation().scale


def cmd_privacy_plan(args: argparse.Namespace) -> int:
    if args.mechanism == "secure":
        return _secure(args)
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


def _secure(args: argparse.Namespace) -> int:
    """The public rule's ``k`` for a secure fleet (secagg/dimension.py), with what it saw."""
    needed = ("devices", "dataset_size", "classes", "quorum", "colluding")
    missing = [f"--{n.replace('_', '-')}" for n in needed if getattr(args, n) is None]
    if missing:
        raise UsageError(f"--mechanism secure needs {', '.join(missing)}")
    facts = {n: getattr(args, n) for n in needed}
    try:
        k = public_dim(**facts, epsilon=args.epsilon, delta=args.delta, scale=SCALE,
                       below=args.features or 1 << 30, basis=args.basis)  # fmt: skip
        sigma = sum_sigma(k, devices=args.devices, classes=args.classes, epsilon=args.epsilon,
                          delta=args.delta, scale=SCALE, quorum=args.quorum,
                          colluding=args.colluding) if args.epsilon > 0 else 0.0  # fmt: skip
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    ratio = noise_ratio(k, rows=args.devices * args.dataset_size, sigma=sigma)
    report = {"mechanism": "secure", "dim": k, "noise_ratio": round(ratio, 4),
              "least_ratio": round(BASIS_RATIO if args.basis else RATIO, 4),
              "basis": args.basis, "sum_std": round(sigma, 4), **facts,
              "epsilon": args.epsilon, "delta": args.delta}  # fmt: skip
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0
