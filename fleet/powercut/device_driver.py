"""A device that answers rounds as fast as it can, for the device power-cut test
(fleet/powercut/device_cuts.py): ``python -m fleet.powercut.device_driver AGENT_TOML``.

It is the agent's own core (:class:`edge_agent.agent.Agent`: privacy ledger, state
directory, update) answering one announcement after another; what the MQTT service would
publish it writes to stdout instead, one line per release (``released <round> <sha256>``),
flushed before the next round: stdout is the wire, and a line out is a release that left
the device. It resumes from the round after the last one its state says it answered.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np

from edge_agent.agent import Agent
from edge_agent.config import load
from protocol import RoundAnnouncement

RUN, RUN_STARTED = "powercut-run", 1_700_000_000.0


def announcement(
    agent: Agent, round_: int, *, classes: int = 10, dim: int = 32
) -> RoundAnnouncement:
    """Round ``round_`` as a coordinator would announce it (later rounds with globals)."""
    globals_: dict[str, object] = {}
    if round_ > 0:
        protos = np.random.default_rng(round_).normal(size=(classes, dim)).astype(np.float32)
        protos /= np.linalg.norm(protos, axis=1, keepdims=True)
        globals_ = {"global_classes": tuple(range(classes)), "global_prototypes": protos}
    return RoundAnnouncement(
        fleet=agent.cfg.fleet, round=round_, run=RUN, run_started=RUN_STARTED,
        bundle=agent.bundle_id, method=agent.cfg.method,
        classes=tuple(str(c) for c in range(classes)), dim=dim, deadline=time.time() + 600,
        params={"final": False}, **globals_,  # type: ignore[arg-type]
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    (config,) = argv if argv is not None else sys.argv[1:]
    agent = Agent(load(Path(config)))
    round_ = 0 if agent.last_round is None else agent.last_round
    while True:
        decision = agent.handle(announcement(agent, round_))
        payload = decision.payload
        if payload is None and decision.update is not None:
            payload = decision.update.to_wire()
        if payload is not None:
            print(f"released {round_} {hashlib.sha256(payload).hexdigest()}", flush=True)
        round_ += 1


if __name__ == "__main__":
    sys.exit(main())
