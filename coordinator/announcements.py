"""What the coordinator sends: every message signed for this run, and each round's
announcement built from the strategy's aggregate in the fleet's announced dtype."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import numpy as np

from coordinator.config import CoordinatorConfig
from coordinator.keys import CoordinatorKeys
from coordinator.strategies import Aggregate
from protocol import RoundAnnouncement
from protocol.auth import sign

M = TypeVar("M")


class Announcer:
    """Signs for run ``run_id`` with the coordinator's key (or not at all, when the fleet
    runs insecure) and builds the announcement that opens a round."""

    def __init__(self, *, config: CoordinatorConfig, keys: CoordinatorKeys, run_id: str) -> None:
        self.config = config
        self.keys = keys
        self.run_id = run_id
        self._dtype: type[np.floating[Any]] = (
            np.float16 if config.model.announce_dtype == "f2" else np.float32
        )

    def sign(self, message: M) -> M:
        """``message`` signed by the coordinator for this run (as is, when insecure)."""
        unsigned = dataclasses.replace(message, auth=None)  # type: ignore[type-var]
        if self.keys.signer is None:
            return unsigned
        return sign(unsigned, self.keys.signer, run=self.run_id)

    def announce(
        self, round_: int, result: Aggregate, *, deadline: float, final: bool = False
    ) -> RoundAnnouncement:
        """The signed announcement of round ``round_``, carrying ``result``."""
        model = self.config.model
        cast = self._dtype
        dim = model.dim if result.global_classes else 0
        protos = np.asarray(result.global_prototypes, dtype=cast).reshape(
            len(result.global_classes), dim
        )
        return self.sign(
            RoundAnnouncement(
                fleet=self.config.fleet,
                round=round_,
                bundle=model.bundle,
                method=model.method,
                classes=model.classes,
                deadline=deadline,
                params={**model.params, "final": final},
                global_classes=result.global_classes,
                global_prototypes=protos,
                local_sets={c: np.asarray(a, dtype=cast) for c, a in result.local_sets.items()},
                client_globals={
                    c: np.asarray(a, dtype=cast) for c, a in result.client_globals.items()
                },
                extras={n: np.asarray(a, dtype=np.float32) for n, a in result.extras.items()},
            )
        )
