"""``edge-fleet demo``: the newcomer's first run (``make demo``).

It runs what the toolkit has today and says plainly what it does not have yet.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from protocol import PrototypeUpdate, update_topic

PENDING = (
    "The simulated fleet (coordinator, agents, digits-5 benchmark) is not built yet;\n"
    "this demo shows the part that exists: the wire protocol every device speaks."
)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "demo",
        help="the quick-start run behind `make demo`",
        description="Run the quick-start demonstration of what ProtoFleet can do today.",
    )
    parser.add_argument("--clients", type=int, default=5, help="simulated clients (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def main(args: argparse.Namespace) -> int:
    print(PENDING, end="\n\n")
    rng = np.random.default_rng(args.seed)
    print(f"{'client':<10} {'topic':<36} {'bytes':>6} {'round trip':>11}")
    for i in range(args.clients):
        client = f"device-{i}"
        z = rng.normal(size=(10, 256)).astype(np.float32)
        z /= np.linalg.norm(z, axis=1, keepdims=True)  # prototypes of unit-norm features
        update = PrototypeUpdate(
            fleet="demo",
            round=0,
            client=client,
            bundle="0" * 64,
            method="fedpcl",
            classes=tuple(range(10)),
            counts=tuple(int(c) for c in rng.integers(20, 200, size=10)),
            prototypes=z.astype(np.float16),
        )
        start = time.perf_counter()
        payload = update.to_wire()
        same = PrototypeUpdate.from_wire(payload) == update
        micros = (time.perf_counter() - start) * 1e6
        status = f"{micros:7.0f} us" if same else "MISMATCH"
        print(f"{client:<10} {update_topic('demo', client):<36} {len(payload):>6} {status:>11}")
    print("\nEach update: 10 classes x 256 dims as float16, validated on decode.")
    return 0
