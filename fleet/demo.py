"""``edge-fleet demo``: the newcomer's first run (``make demo``).

A real fleet on this machine: a private Mosquitto, the coordinator and one agent per
digits-5 domain, each its own process talking MQTT, running FedPCL rounds on the built-in
zoo. It prints each device's test accuracy per round. Method comparisons, reports and
plots come with ``edge-fleet run`` and ``compare``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from fleet.broker import BrokerError, MosquittoBroker
from fleet.digits5 import DOMAINS, domain_data
from protocol import RoundAnnouncement, round_topic
from protocol.cliutil import UsageError

BIN = Path(sys.executable).parent


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "demo",
        help="run a small FedPCL fleet over a real broker (what `make demo` runs)",
        description="Run a five-device FedPCL fleet on digits-5 over a private Mosquitto.",
    )
    parser.add_argument(
        "--clients", type=int, default=5, help="devices, one digits-5 domain each (1-5; default 5)"
    )
    parser.add_argument("--rounds", type=int, default=8, help="federated rounds (default 8)")
    parser.add_argument(
        "--train", type=int, default=300, help="training images per device (default 300)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="working folder (default runs/demo)"
    )
    parser.add_argument(
        "--zoo",
        type=Path,
        default=Path("runs/zoo"),
        help="bundle to use; built here if missing (default runs/zoo)",
    )
    parser.add_argument(
        "--zoo-size",
        choices=["small", "full"],
        default="full",
        help="zoo to build if missing (default full, ~5 min once)",
    )
    parser.add_argument("--seed", type=int, default=0)


def _write_client_data(
    root: Path, domain: str, index: int, train: int, seed: int
) -> tuple[Path, Path]:
    # Disjoint slices of the 1,797 digits per device and split, so no test image is seen in training.
    rng = np.random.default_rng([seed, index])
    order = rng.permutation(1797)
    test = 150
    x_train, y_train = domain_data(domain, seed=seed, indices=order[:train])
    x_test, y_test = domain_data(domain, seed=seed + 1, indices=order[train : train + test])
    root.mkdir(parents=True, exist_ok=True)
    np.savez(root / "train.npz", x=(x_train * 255).astype(np.uint8), y=y_train)
    np.savez(root / "test.npz", x=(x_test * 255).astype(np.uint8), y=y_test)
    return root / "train.npz", root / "test.npz"


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.clients <= len(DOMAINS):
        raise UsageError(f"--clients must be 1-{len(DOMAINS)} (one digits-5 domain each)")
    if args.rounds < 1 or args.train < 20:
        raise UsageError("--rounds must be >= 1 and --train >= 20")
    from export import bundle as bundle_mod

    if not (args.zoo / "bundle.json").exists():
        print(f"building the {args.zoo_size} backbone zoo in {args.zoo} (once) ...", flush=True)
        done = subprocess.run(
            [str(BIN / "edge-export"), "zoo", "--out", str(args.zoo), "--size", args.zoo_size],
            stdout=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            return done.returncode
    bundle = bundle_mod.load(args.zoo)
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    clients = [f"device-{i}-{DOMAINS[i]}" for i in range(args.clients)]
    try:
        broker = MosquittoBroker().start()
    except BrokerError as exc:
        raise UsageError(f"{exc}. The demo needs Mosquitto: apt-get install mosquitto") from exc
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port = broker.address.port
        coordinator_cfg = run_dir / "coordinator.toml"
        run_dir.mkdir(parents=True)
        allow = ", ".join(f'"{c}"' for c in clients)
        coordinator_cfg.write_text(
            f'fleet = "demo"\nstate_dir = "{run_dir / "coordinator"}"\n'
            f'[model]\nmethod = "fedpcl"\nbundle = "{bundle.id}"\n'
            f"[rounds]\nmin_clients = {args.clients}\nwait_after_quorum_s = 0.0\ntimeout_s = 300.0\n"
            f"max_rounds = {args.rounds}\nallow_list = [{allow}]\n[mqtt]\nport = {port}\n"
        )
        logs = run_dir / "logs"
        logs.mkdir()
        procs.append(
            _spawn(
                ["edge-coordinator", "run", "--config", str(coordinator_cfg)],
                logs / "coordinator.log",
            )
        )
        for i, client in enumerate(clients):
            train, test = _write_client_data(run_dir / client, DOMAINS[i], i, args.train, args.seed)
            config = run_dir / client / "agent.toml"
            config.write_text(
                f'agent_id = "{client}"\nfleet = "demo"\nstate_dir = "{run_dir / client / "state"}"\n'
                f'bundle = "{args.zoo}"\nseed = {args.seed + i}\n'
                f'[data]\ntrain = "{train}"\ntest = "{test}"\n[mqtt]\nport = {port}\n'
            )
            procs.append(
                _spawn(["edge-agent", "run", "--config", str(config)], logs / f"{client}.log")
            )
        print(
            f"fleet: Mosquitto on 127.0.0.1:{port}, coordinator and {args.clients} agents (logs in {logs})\n"
        )
        _follow(broker, run_dir, clients, args.rounds, procs)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the fleet", file=sys.stderr)
        return 130
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        broker.stop()
    return 0


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:
        return subprocess.Popen(
            [str(BIN / argv[0]), *argv[1:]],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _accuracy(run_dir: Path, client: str, round_: int) -> float | None:
    try:
        state = json.loads((run_dir / client / "state" / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for entry in state.get("history", []):
        if entry.get("round") == round_:
            return entry.get("test_accuracy")
    return None


def _beyond(seen: list[int], done: int) -> bool:
    return max(seen, default=-1) > done


def _follow(
    broker: MosquittoBroker,
    run_dir: Path,
    clients: list[str],
    rounds: int,
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Print a row per completed round, from the retained announcements and the agents' records."""
    import threading

    import paho.mqtt.client as mqtt

    seen: list[int] = []
    cond = threading.Condition()

    def on_message(client: Any, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            ann = RoundAnnouncement.from_wire(message.payload)
        except ValueError:
            return
        with cond:
            seen.append(ann.round)
            cond.notify_all()

    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="demo-watcher")
    watcher.on_message = on_message
    watcher.on_connect = lambda c, u, f, rc, p: c.subscribe(round_topic("demo"), qos=1)
    watcher.connect(broker.address.host, broker.address.port)
    watcher.loop_start()
    short = [c.split("-", 2)[-1] for c in clients]
    print(
        f"{'round':>5}  "
        + "  ".join(f"{s:>8}" for s in short)
        + f"  {'mean':>6}   (test accuracy, prototype inference)"
    )
    printed = 0
    try:
        while printed < rounds:
            with cond:
                if not cond.wait_for(partial(_beyond, seen, printed), timeout=600):
                    raise UsageError("no progress for 10 minutes; see the logs")
            if any(p.poll() not in (None, 0) for p in procs):
                raise UsageError(f"a fleet process failed; see the logs in {run_dir / 'logs'}")
            accs = [_accuracy(run_dir, c, printed) for c in clients]
            cells = "  ".join(f"{a:8.3f}" if a is not None else f"{'-':>8}" for a in accs)
            mean = (
                np.mean([a for a in accs if a is not None])
                if any(a is not None for a in accs)
                else float("nan")
            )
            print(f"{printed:>5}  {cells}  {mean:6.3f}", flush=True)
            printed += 1
    finally:
        watcher.loop_stop()
        watcher.disconnect()
    print(f"\n{rounds} FedPCL rounds over MQTT. Run folder: {run_dir}")
