"""The coordinator's store and round manager as a vector run drives them
(fleet/transports/vector_records.py): the real ones, less the work a run with no devices
and no restart would throw away.

- :class:`VectorStore` stores each accepted update's row (round, client, arrival) and its
  client's tally, with an empty payload: a vector run cannot resume and aggregates what it
  decoded on arrival, and would otherwise write every FedAvg model of every round to disk
  for nobody to read (0.2 GB a round at 1,000 clients).
- :class:`VectorRoundManager` computes no receipt digest (no device awaits one) and keeps
  each update as decoded on arrival, which the close aggregates instead of reading the
  payload back and decoding it again (most of a close's work for a FedAvg round).
"""

from __future__ import annotations

from coordinator.config import CoordinatorConfig
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import StateError, Store
from protocol import PrototypeUpdate
from protocol.methods import wire_method


class VectorStore(Store):
    """A store that keeps no update payloads. Reading one back raises :class:`StateError`,
    so this database cannot be resumed; a coordinator service opening it refuses it as
    another fleet's (its identity says it keeps no payloads)."""

    def bind_identity(self, identity: dict[str, str]) -> None:
        super().bind_identity({**identity, "payloads": "none"})

    def add_update(self, round_: int, client: str, payload: bytes, *, received_at: float) -> bool:
        return super().add_update(round_, client, b"", received_at=received_at)

    def updates(self, round_: int) -> list[tuple[str, bytes]]:
        return [
            (c, _kept(p, f"update of {c} in round {round_}")) for c, p in super().updates(round_)
        ]

    def update_payload(self, round_: int, client: str) -> bytes:
        return _kept(
            super().update_payload(round_, client), f"update of {client} in round {round_}"
        )

    def statistics_of(self, client: str) -> bytes:
        return _kept(super().statistics_of(client), f"statistics of {client}")


def _kept(payload: bytes, what: str) -> bytes:
    """``payload``, or StateError for one stored without it: no update's wire form is
    empty, so an empty one was left out, never lost."""
    if not payload:
        raise StateError(
            f"the {what} was stored without its payload (a vector run keeps no payloads): "
            "this database cannot be resumed or served"
        )
    return payload


class VectorRoundManager(RoundManager):
    """The round manager of a vector run, on a :class:`VectorStore`."""

    def __init__(self, *, config: CoordinatorConfig, store: VectorStore, metrics: Metrics) -> None:
        super().__init__(config=config, store=store, metrics=metrics)
        # The open round's updates as decoded on arrival, until the close takes them.
        # Nothing rewrites a stored update once the manager is built (quarantine runs
        # at resume), so each is what the store holds. A closed-form close solves from
        # the statistics summed on arrival instead, and holding them (every client's
        # second moments, in round 0) would cost what the sums save.
        self._held: dict[str, PrototypeUpdate] = {}
        self._holds = not wire_method(config.model.method).closed_form

    def _stored(self, update: PrototypeUpdate, payload: bytes | bytearray) -> str | None:
        if self._holds:
            self._held[update.client] = update
        return None  # no device awaits a receipt

    def _stored_update(self, client: str) -> PrototypeUpdate:
        held = self._held.pop(client, None)
        return held if held is not None else super()._stored_update(client)
