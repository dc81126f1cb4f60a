"""What a vector run keeps of its clients (scores and traffic per round) and the rounds
it drives against the real round manager and store: shared by the trained methods'
engine (fleet/transports/vector.py) and the closed-form methods' (fleet/transports/vector_closed_form.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.config import CoordinatorConfig
from coordinator.metrics import Metrics
from coordinator.rounds.secure import SecureOutcome
from fleet.engine.batch import SCORES
from fleet.transports.progress import log_round, progress_bar
from fleet.transports.spec import ClientRecord, RunSpec
from fleet.transports.vector_coordinator import VectorRoundManager, VectorStore
from protocol import DEFAULT_MAX_PAYLOAD_BYTES, RoundAnnouncement
from runtime.faults import crash_point
from runtime.settings import build


@dataclass
class Records:
    """Per client and round: the three scores and the bytes each way (NaN: none)."""

    clients: int
    rounds: int
    scores: dict[str, np.ndarray] = field(init=False)
    bytes_up: np.ndarray = field(init=False)
    bytes_down: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.clients, self.rounds)
        self.scores = {n: np.full(shape, np.nan) for n in SCORES}
        self.bytes_up = np.zeros(shape, np.int64)
        self.bytes_down = np.zeros(shape, np.int64)

    def set(self, k: int, r: int, scores: dict[str, float | None]) -> None:
        if r < self.rounds:
            for name, value in scores.items():
                self.scores[name][k, r] = np.nan if value is None else value

    def client(self, k: int, *, name: str, domain: str) -> ClientRecord:
        def col(a: np.ndarray) -> tuple[float | None, ...]:
            return tuple(None if np.isnan(v) else float(v) for v in a[k])

        return ClientRecord(
            name=name,
            domain=domain,
            accuracy=col(self.scores["test_accuracy"]),
            accuracy_prototype=col(self.scores["test_accuracy_prototype"]),
            accuracy_classifier=col(self.scores["test_accuracy_classifier"]),
            bytes_up=tuple(int(b) for b in self.bytes_up[k]),
            bytes_down=tuple(int(b) for b in self.bytes_down[k]),
        )


#: Updates stored per transaction: one commit per update would be most of a round's time.
OFFER_BATCH = 256


def offer(manager: VectorRoundManager, store: VectorStore, pending: list[tuple[int, bytes]], names: list[str],
           records: Records, round_: int) -> None:  # fmt: skip
    with store.batch():
        for k, payload in pending:
            outcome = manager.offer(payload, topic_client=names[k])
            if not outcome.accepted:
                raise RuntimeError(f"the coordinator rejected {names[k]}: {outcome.reason}")
            records.bytes_up[k, round_] = len(payload)


def offer_round(manager: VectorRoundManager, store: VectorStore, updates: Iterable[tuple[int, bytes]], *,
                names: list[str], records: Records, round_: int, wire_bytes: int,
                bar: Any) -> None:  # fmt: skip
    """Offer a round's updates ((client index, payload), as they are made) in batches of
    :data:`OFFER_BATCH`, recording each client's traffic; then close the round."""
    pending: list[tuple[int, bytes]] = []
    for k, payload in updates:
        pending.append((k, payload))
        records.bytes_down[k, round_] = wire_bytes
        if len(pending) == OFFER_BATCH:
            offer(manager, store, pending, names, records, round_)
            bar.update(len(pending))
            pending = []
    offer(manager, store, pending, names, records, round_)
    bar.update(len(pending))
    if manager.poll() is None:
        raise RuntimeError(f"round {round_} did not close")


def drive_rounds(
    *,
    spec: RunSpec,
    coord: dict[str, Any],
    names: list[str],
    records: Records,
    adopt: Callable[[RoundAnnouncement], None],
    updates: Callable[[RoundAnnouncement], Iterator[tuple[int, bytes]]],
    secure_round: Callable[[RoundAnnouncement], SecureOutcome] | None = None,
    observe: Callable[[RoundAnnouncement], None] | None = None,
) -> None:
    """``spec.rounds`` rounds against a coordinator built from ``coord`` (its tables): each
    announcement, decoded under the agents' deployed limit as a device would, goes to
    ``adopt``; then, unless it is the final one, ``updates`` makes the round's updates,
    which are offered and the round closed. The store keeps each update's row without its
    payload: a vector run cannot resume, and the close aggregates what the manager decoded
    (fleet/transports/vector_coordinator.py). A secure fleet's round is closed by its
    secure-aggregation round instead: ``secure_round`` gives its outcome, which the manager
    takes as coordinator/rounds/secure_rounds.py hands it over. ``observe``, if given,
    sees each decoded announcement first (a benchmark keeps the announced heads to score
    them after the run, outside the rounds' times): it must be quick, since it runs
    inside a round."""
    cfg = build(CoordinatorConfig, coord)
    store = VectorStore(cfg.database, synchronous=cfg.sqlite_synchronous)
    try:
        manager = VectorRoundManager(config=cfg, store=store, metrics=Metrics())
        with progress_bar(spec, spec.rounds * len(names), f"{spec.method}: client-rounds",
                          "client") as bar:  # fmt: skip
            while True:
                wire = manager.announcement.to_wire()
                announcement = RoundAnnouncement.from_wire(
                    wire, max_bytes=DEFAULT_MAX_PAYLOAD_BYTES
                )
                if observe is not None:
                    observe(announcement)
                adopt(announcement)
                if manager.done:
                    break
                round_ = announcement.round
                if secure_round is None:
                    offer_round(manager, store, updates(announcement), names=names,
                                records=records, round_=round_, wire_bytes=len(wire),
                                bar=bar)  # fmt: skip
                else:
                    records.bytes_down[:, round_] = len(wire)
                    taken = manager.take_secure(secure_round(announcement))
                    if not taken or manager.poll() is None:
                        raise RuntimeError(f"round {round_} did not close")
                    bar.update(len(names))
                log_round(spec, round_ + 1)
                crash_point(f"fleet:{spec.method}:round_closed")
    finally:
        store.close()
