"""``edge-agent run``: take the agent's locks, load its bundle and serve rounds until
stopped (or reloaded)."""

from __future__ import annotations

import argparse
import contextlib
import time

from edge_agent.config import AgentConfig
from edge_agent.config import load as load_config
from edge_agent.data import DataError
from edge_agent.service import AgentService
from export.errors import BundleError
from runtime.cliutil import UsageError
from runtime.lifecycle import CannotServe, serve
from runtime.runlock import AlreadyRunning, RunLock
from runtime.transport import load_credentials


def cmd_run(args: argparse.Namespace) -> int:
    def make(cfg: AgentConfig) -> AgentService:
        # Lazy: the agent's module imports torch, seconds to load; `--help` and a mistake
        # in the configuration file are told without that wait.
        from edge_agent.agent import Agent

        with contextlib.ExitStack() as taken:  # released again if the start fails
            try:
                # The broker's files first: a mistyped path is told before the backbones run.
                load_credentials(cfg.mqtt)
                taken.enter_context(RunLock.take(cfg.run_lock, what=f"agent state {cfg.state_dir}"))
                cache = cfg.data.feature_cache
                if cache is not None and not cfg.data.shared_feature_cache:
                    # A private cache drops entries it does not own: two agents on one would
                    # delete each other's features every start.
                    taken.enter_context(
                        RunLock.take(
                            cache / "run.lock",
                            what=f"feature cache {cache}",
                            remedy="stop that one first, or set [data] shared_feature_cache = "
                            "true in every agent that uses it",
                        )
                    )
                agent = Agent(cfg)
            except (AlreadyRunning, BundleError, DataError, ValueError) as exc:
                raise CannotServe(str(exc)) from exc
            agent.state.record(
                active_providers=agent.runtime.active_providers,
                backbone_samples_at_start=agent.runtime.samples_processed,
                started_at=time.time(),
            )
            held.append(taken.pop_all())
        return AgentService(agent=agent)

    def close(service: object) -> None:
        held.pop().close()  # before a reload's make(), which takes the same locks

    held: list[contextlib.ExitStack] = []
    try:
        serve(name="edge-agent", load=lambda: load_config(args.config), make=make, close=close)
    except CannotServe as exc:
        raise UsageError(str(exc)) from exc
    return 0
