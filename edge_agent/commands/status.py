"""``edge-agent status``: this agent's state as JSON, read from its state folder without
starting it (whether or not an agent runs on that folder now)."""

from __future__ import annotations

import argparse
import json
import sys

from edge_agent.config import AgentConfig
from edge_agent.config import load as load_config
from edge_agent.features import FeatureCache
from edge_agent.privacy.ledger import Ledger, LedgerError
from edge_agent.state import StateDir
from runtime.cliutil import UsageError
from runtime.runlock import holder


def cmd_status(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    try:
        state = StateDir(cfg.state_dir, agent_id=cfg.agent_id, create=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    snap = state.snapshot
    report = {
        "agent_id": cfg.agent_id,
        "fleet": cfg.fleet,
        "method": cfg.method,
        # Signed messages, or the explicit choice to go without them.
        "security": "insecure" if cfg.security.insecure else "signed",
        "running_pid": holder(cfg.run_lock),  # null: no agent runs on this state
        "bundle_id": snap.bundle_id,
        # The coordinator run followed; last_round counts in it (docs/protocol.md, "Runs").
        "run": snap.run,
        "last_round": snap.last_round,
        "pending_round": snap.pending_round,
        "cache_entries": FeatureCache(cfg.data.feature_cache or state.cache_dir).entries(),
        "active_providers": snap.extra.get("active_providers"),
        "privacy": _privacy_status(cfg, snap.extra),
        # Announcements refused as no coordinator of this fleet would send them, by reason.
        "ignored_announcements": snap.extra.get("ignored_announcements", {}),
        "last_metrics": snap.history[-1] if snap.history else None,
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


def _privacy_status(cfg: AgentConfig, extra: dict[str, object]) -> dict[str, object]:
    p = cfg.privacy
    out: dict[str, object] = {"mechanism": p.mechanism, "epsilon_spent": None,
                              "guarantee": p.guarantee}  # fmt: skip
    if p.formal:
        try:
            ledger = Ledger(
                cfg.state_dir, epsilon_budget=p.epsilon, delta=p.delta, accountant=p.accountant
            )
        except LedgerError as exc:
            raise UsageError(str(exc)) from exc
        out |= {
            "epsilon_spent": ledger.spent(),
            "epsilon_budget": p.epsilon,
            "delta": p.delta,
            "accountant": p.accountant,
            "releases": len(ledger.spends),
            # What the ledger's past spends claim, whatever the configuration says now.
            "guarantee": ledger.guarantee if ledger.spends else p.guarantee,
            "publishing": not extra.get("privacy_exhausted", False),
        }
    return out
