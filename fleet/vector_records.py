"""What a vector run keeps of its clients (scores and traffic per round) and how it hands
their updates to the round manager: shared by the trained methods' engine
(fleet/vector_run.py) and the closed-form methods' (fleet/vector_closed_form.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleet.spec import ClientRecord
from fleet.vector_engine import SCORES


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


def offer(manager: Any, store: Any, pending: list[tuple[int, bytes]], names: list[str],
           records: Records, round_: int) -> None:  # fmt: skip
    with store.batch():
        for k, payload in pending:
            # No device here awaits a receipt: the digest it would name is not computed.
            outcome = manager.offer(payload, topic_client=names[k], receipt=False)
            if not outcome.accepted:
                raise RuntimeError(f"the coordinator rejected {names[k]}: {outcome.reason}")
            records.bytes_up[k, round_] = len(payload)
