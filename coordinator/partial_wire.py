"""The coordinator tier's own message: one worker's partial sum for one round.

Internal to the coordinator tier (workers and their combiner, docs/scale.md): it travels on
``protofleet-tier/v1/<fleet>/...`` topics, outside the device protocol's ``protofleet/v1/``
tree, no device reads or writes it, and docs/protocol.md does not describe it. It is still
decoded as strictly as a device's message (the same msgpack framing and byte cap, every key
and length checked), since a broker carries it. Arrays are raw little-endian float64 (int64
for ``holders``): float16 would round the sums the global prototypes are divided out of.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.partial import PartialSum, merge
from protocol.codec import pack, unpack
from protocol.errors import MalformedPayload
from protocol.ids import validate_id
from protocol.limits import MAX_CLASSES

TIER_ROOT = "protofleet-tier/v1"
VERSION = 1
#: A partial's byte cap: arrays of 4,096 classes x 1,024 dimensions and a million client ids
#: fit; the arrays are a few hundred kB at a realistic 10 x 256, the ids grow with the slice.
MAX_PARTIAL_BYTES = 256 << 20
MAX_DIM = 1 << 16
_KEYS = {"v", "type", "fleet", "round", "worker", "weighted", "counts", "plain", "holders"}
_KEYS |= {"classes", "dim", "clients"}


def partial_topic(fleet: str, worker: str) -> str:
    return f"{TIER_ROOT}/{validate_id(fleet, field='fleet')}/partial/{validate_id(worker, field='worker')}"


def partial_filter(fleet: str) -> str:
    return f"{TIER_ROOT}/{validate_id(fleet, field='fleet')}/partial/+"


def collect_topic(fleet: str) -> str:
    """Where the combiner asks every worker for its partial sum of a round."""
    return f"{TIER_ROOT}/{validate_id(fleet, field='fleet')}/collect"


@dataclass(frozen=True)
class PartialMessage:
    fleet: str
    round: int
    worker: str
    partial: PartialSum

    def to_wire(self) -> bytes:
        p = self.partial
        return pack(
            {
                "v": VERSION,
                "type": "partial",
                "fleet": self.fleet,
                "round": self.round,
                "worker": self.worker,
                "classes": p.num_classes,
                "dim": p.dim,
                "weighted": np.ascontiguousarray(p.weighted, "<f8").tobytes(),
                "counts": np.ascontiguousarray(p.counts, "<f8").tobytes(),
                "plain": np.ascontiguousarray(p.plain, "<f8").tobytes(),
                "holders": np.ascontiguousarray(p.holders, "<i8").tobytes(),
                "clients": sorted(p.clients),
            }
        )

    @classmethod
    def from_wire(cls, payload: object, *, max_bytes: int = MAX_PARTIAL_BYTES) -> PartialMessage:
        """Decode and check a partial; any problem is a ``MalformedPayload``."""
        obj = unpack(payload, max_bytes=max_bytes)
        if set(obj) != _KEYS or obj["v"] != VERSION or obj["type"] != "partial":
            raise MalformedPayload(f"not a version {VERSION} partial sum")
        c, d = _int(obj, "classes", 1, MAX_CLASSES), _int(obj, "dim", 1, MAX_DIM)
        clients = obj["clients"]
        if not isinstance(clients, list) or not all(isinstance(x, str) for x in clients):
            raise MalformedPayload("clients must be a list of strings", field="clients")
        try:
            for client in clients:
                validate_id(client, field="clients")
            partial = PartialSum(
                weighted=_array(obj, "weighted", "<f8", (c, d)),
                counts=_array(obj, "counts", "<f8", (c,)),
                plain=_array(obj, "plain", "<f8", (c, d)),
                holders=_array(obj, "holders", "<i8", (c,)),
                clients=frozenset(clients),
            )
            if len(partial.clients) != len(clients):
                raise ValueError("a client is listed twice")
            return cls(
                fleet=validate_id(obj["fleet"], field="fleet"),
                round=_int(obj, "round", 0, 2**31 - 1),
                worker=validate_id(obj["worker"], field="worker"),
                partial=partial,
            )
        except ValueError as exc:  # the ids' and PartialSum's own checks
            raise MalformedPayload(f"bad partial sum: {exc}") from exc


def combine(messages: Iterable[PartialMessage], *, fleet: str, round_: int) -> PartialSum:
    """The round's partial sum over every worker's: refuses another fleet's or round's
    message, two from one worker, and (through :func:`merge`) a client counted twice."""
    batch = list(messages)
    stray = [m.worker for m in batch if (m.fleet, m.round) != (fleet, round_)]
    if stray:
        raise ValueError(f"partials of another fleet or round from {', '.join(stray)}")
    workers = [m.worker for m in batch]
    if len(set(workers)) != len(workers):
        raise ValueError("two partial sums from one worker")
    return merge(m.partial for m in batch)


def _int(obj: dict[str, Any], key: str, low: int, high: int) -> int:
    value = obj[key]
    if type(value) is not int or not low <= value <= high:
        raise MalformedPayload(f"must be an integer in {low}..{high}", field=key)
    return value


def _array(obj: dict[str, Any], key: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    data = obj[key]
    size = int(np.prod(shape)) * 8
    if not isinstance(data, bytes) or len(data) != size:
        raise MalformedPayload(f"must be {size} bytes of {dtype}", field=key)
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype[1:])
