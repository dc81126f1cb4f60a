"""``edge-coordinator``: the ProtoFleet aggregation service."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from coordinator import config as config_mod
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.service.owner_service import OwnerService
from coordinator.service.service import CoordinatorService
from coordinator.storage.schema import DamagedDatabase
from coordinator.storage.store import StateError, StorageFault, Store
from coordinator.storage.store_rows import damaged_message
from coordinator.tier import worker as worker_mod
from coordinator.tier.owner import RoundOwner, refusal
from coordinator.tier.worker_ledger import WorkerMetrics, worker_summary
from runtime.cliutil import (
    CommandFailed,
    UsageError,
    add_example_config,
    make_parser,
    print_example_config,
    run,
)
from runtime.lifecycle import CannotServe, serve
from runtime.runlock import AlreadyRunning, RunLock, holder
from runtime.transport import CredentialsError, load_credentials

EXAMPLE = Path(__file__).resolve().parent.parent / "coordinator.toml"


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-coordinator",
        "Run federated rounds: announce global prototypes, collect device updates over\n"
        "MQTT, aggregate them with the fleet's strategy and keep durable state in SQLite.",
        epilog="Configuration: a TOML file; `edge-coordinator example-config` prints one\n"
        "with every key.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_run = sub.add_parser(
        "run",
        help="serve rounds until stopped (or until max_rounds); with [workers], as the "
        "round owner over the workers",
    )
    p_run.add_argument("--config", "-c", type=Path, required=True, help="coordinator TOML file")
    p_worker = sub.add_parser(
        "worker", help="one worker of the sharded intake ([workers], docs/scale.md)"
    )
    p_worker.add_argument("--config", "-c", type=Path, required=True, help="coordinator TOML file")
    p_worker.add_argument(
        "--name", required=True, help="this worker's id: one of [workers] names (w1... for count)"
    )
    p_worker.add_argument("--db", type=Path, help="default: <state_dir>/worker-<name>.sqlite3")
    p_status = sub.add_parser(
        "status", help="print the coordinator's state as JSON (read from its database)"
    )
    p_status.add_argument("--config", "-c", type=Path, required=True, help="coordinator TOML file")
    p_forget = sub.add_parser(
        "forget",
        help="drop one client's closed-form statistics from the fleet's sum (a running "
        "coordinator is told to reload)",
    )
    p_forget.add_argument("client", help="the client id whose statistics to drop")
    p_forget.add_argument("--config", "-c", type=Path, required=True, help="coordinator TOML file")
    add_example_config(
        sub, prog="edge-coordinator", example=EXAMPLE, config=config_mod.CoordinatorConfig
    )
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    metrics = Metrics()

    def make(cfg: config_mod.CoordinatorConfig) -> CoordinatorService | OwnerService:
        with contextlib.ExitStack() as taken:  # released again if the start fails
            try:
                problem = refusal(cfg) if cfg.workers.enabled else None
                if problem is not None:
                    raise CannotServe(problem)
                # The broker's files first: nothing is opened for a config that cannot connect.
                load_credentials(cfg.mqtt)
                taken.enter_context(
                    RunLock.take(cfg.run_lock, what=f"coordinator database {cfg.database}")
                )
            except (AlreadyRunning, CredentialsError) as exc:
                raise CannotServe(str(exc)) from exc
            service = build(cfg)
            held.append(taken.pop_all())
        return service

    def build(cfg: config_mod.CoordinatorConfig) -> CoordinatorService | OwnerService:
        try:
            # A round owner commits once a round and sends no receipts: under GROUP its
            # closes are fsync'd each (FULL), costing nothing a batch would save.
            group_owner = cfg.workers.enabled and cfg.sqlite_synchronous == "GROUP"
            store = Store(
                cfg.database, synchronous="FULL" if group_owner else cfg.sqlite_synchronous
            )
        except StateError as exc:
            raise CannotServe(str(exc)) from exc
        try:
            driver: RoundManager | RoundOwner
            if cfg.workers.enabled:
                if not per_worker:  # once per process: the registry outlives reloads
                    per_worker.append(WorkerMetrics(metrics.registry))
                driver = RoundOwner(
                    config=cfg, store=store, metrics=metrics, worker_metrics=per_worker[0]
                )
            else:
                driver = RoundManager(config=cfg, store=store, metrics=metrics)
        except (StateError, ValueError) as exc:
            store.close()
            raise CannotServe(str(exc)) from exc
        except sqlite3.Error as exc:  # a full disk at start: one line, exit 1, a restart
            store.close()
            raise StorageFault(exc) from exc
        # The registry is the process's, so counters outlive reloads; the endpoint moves
        # when a reload changes its address (a refused reload rebinds the old one).
        wanted = (cfg.metrics.host, cfg.metrics.port) if cfg.metrics.port else None
        if wanted != metrics.address:
            metrics.stop_serving()
            if wanted is not None:
                try:
                    metrics.serve(host=wanted[0], port=wanted[1])
                except OSError as exc:
                    store.close()
                    raise CannotServe(
                        f"cannot serve metrics on {wanted[0]}:{wanted[1]}: {exc.strerror}"
                    ) from exc
        if isinstance(driver, RoundOwner):
            return OwnerService(owner=driver)
        return CoordinatorService(manager=driver)

    def close(service: object) -> None:
        if isinstance(service, OwnerService):
            service.owner.close()
            service.owner.store.close()
        else:
            assert isinstance(service, CoordinatorService)
            service.manager.store.close()
        held.pop().close()  # before a reload's make(), which takes the lock again

    held: list[contextlib.ExitStack] = []
    per_worker: list[WorkerMetrics] = []
    try:
        serve(
            name="edge-coordinator",
            load=lambda: config_mod.load(args.config),
            make=make,
            close=close,
        )
    except CannotServe as exc:
        raise UsageError(str(exc)) from exc
    return 0


def _existing_store(cfg: config_mod.CoordinatorConfig) -> Store:
    """The coordinator's store, for a command that reads or edits it; a usage error when
    there is none yet or it cannot be opened."""
    if not cfg.database.exists():
        raise UsageError(f"no coordinator state at {cfg.database} (has the coordinator run yet?)")
    try:
        return Store(cfg.database)
    except StateError as exc:
        raise UsageError(str(exc)) from exc


def cmd_status(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config)
    store = _existing_store(cfg)
    try:
        summary = store.summary(online_since=time.time() - cfg.rounds.online_ttl_s)
    finally:
        store.close()
    open_round = summary["round"]
    if open_round is not None and open_round["closed_at"] is None:
        open_round["stalled"] = cfg.stalled(
            round_=open_round["number"],
            updates=open_round["updates"],
            extensions=open_round["extensions"],
        )
    report = {
        "fleet": cfg.fleet,
        "database": str(cfg.database),
        # Signed messages, or the explicit choice to go without them.
        "security": "insecure" if cfg.security.insecure else "signed",
        "running_pid": holder(cfg.run_lock),  # null: no coordinator has this database open
        **summary,
    }
    if cfg.workers.enabled:  # the round owner's record of its workers' shares
        report["workers"] = worker_summary(cfg.database, cfg.workers.members)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    """Drop a client's statistics: the store forgets them, and a running coordinator,
    whose sum holds them in memory, reloads (SIGHUP) to rebuild it without them."""
    cfg = config_mod.load(args.config)
    store = _existing_store(cfg)
    try:
        held = store.forget(args.client)
    finally:
        store.close()
    if not held:
        raise UsageError(f"{cfg.database} holds no statistics of {args.client!r}")
    pid = holder(cfg.run_lock)
    if pid is not None:
        os.kill(pid, signal.SIGHUP)  # the reload rebuilds the sum from the table
    print(
        f"forgot the statistics of {args.client}"
        + (f"; the running coordinator (pid {pid}) reloads without them" if pid else "")
        + ". A device that is still enrolled sends them again with new data: remove its "
        "key (security.devices) to keep it out"
    )
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config)
    if args.name not in cfg.workers.members:
        raise UsageError(
            f"{args.config}: worker {args.name!r} is not one of [workers] names "
            f"{list(cfg.workers.members)}: the round owner would not collect its updates"
        )
    try:
        code = worker_mod.serve(cfg, name=args.name, db=args.db)
    except (CredentialsError, StateError) as exc:
        raise UsageError(str(exc)) from exc
    except DamagedDatabase as exc:
        # Found at open, before anything was written: what to do, as the coordinator says
        # it, rather than a storage fault a restart would clear.
        raise CommandFailed(damaged_message(exc.path, exc)) from exc
    except sqlite3.Error as exc:
        raise StorageFault(exc) from exc
    if code != 0:
        raise CommandFailed(f"worker {args.name}: storage error, intake stopped (see the log)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(
        build_parser(),
        argv,
        handlers={
            "example-config": print_example_config,
            "forget": cmd_forget,
            "run": cmd_run,
            "status": cmd_status,
            "worker": cmd_worker,
        },
    )
