"""The coordinator tier's own messages: a combiner's collect request, and one worker's
partial sum for one round of one run, with the copies it covers.

Internal to the coordinator tier (workers and their combiner, docs/scale.md): they travel
on ``protofleet-tier/v1/<fleet>/...`` topics, outside the device protocol's
``protofleet/v1/`` tree, no device reads or writes them, and docs/protocol.md does not
describe them. They are still decoded as strictly as a device's message (the same msgpack
framing and byte cap, every key and length checked), since a broker carries them. Arrays
are raw little-endian float64 (int64 for ``holders``): float16 would round the sums the
global prototypes are divided out of.

Exactly once across workers: a device's resend may land on another worker than its first
copy, and both store it. Each partial lists its clients with the digest and stored time of
each copy; :func:`exclusions` picks one copy of every client that two partials share, and
the combiner asks the other workers again, naming the clients to leave out
(:class:`CollectRequest` ``exclude``). The merge (:func:`combine`) then counts every
client once, and still refuses partials that share one.

Closed-form methods (version 3): a partial also carries the summed statistics of the
updates it holds (``statistics``, coordinator/tier/partial_statistics.py), and, when the
combiner asks for them (:class:`CollectRequest` ``retract``: client -> the earlier round),
the summed statistics of the earlier copies named (``retraction``), which the clients'
new statistics replace (coordinator/tier/owner_statistics.py). The second moment travels as
its upper triangle (``closed_form/triangles.py``, 1 MB at 512 dimensions);
FedCOF's per-class scatter whole, (C, d, d): 21 MB at 10 classes of 512 dimensions, so a
partial that also carries a retraction stays within the byte cap up to about 60 classes
at 512.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from coordinator.tier.partial import PartialSum, merge
from coordinator.tier.partial_fields import (
    array_field,
    blob_field,
    checked_retract,
    id_field,
    int_field,
    part_fields,
    part_from,
    rounds_field,
    strings_field,
)
from coordinator.tier.partial_statistics import StatisticsPart
from protocol.codec import pack, unpack
from protocol.errors import MalformedPayload
from protocol.ids import validate_id
from protocol.limits import MAX_CLASSES

TIER_ROOT = "protofleet-tier/v1"
#: 3: the closed-form statistics and their retraction (2 had neither).
VERSION = 3
#: A partial's byte cap: arrays of 4,096 classes x 1,024 dimensions and a million clients'
#: ids, digests and times fit; the arrays are a few hundred kB at a realistic 10 x 256, the
#: rest grows with the slice (about 52 bytes a client at 11-character ids).
MAX_PARTIAL_BYTES = 256 << 20
#: A collect request names at most the clients of one worker's partial.
MAX_COLLECT_BYTES = 128 << 20
MAX_DIM = 1 << 16
MAX_ROUND = 2**31 - 1
DIGEST_BYTES = 32
_KEYS = {"v", "type", "fleet", "run", "round", "worker", "weighted", "counts", "plain"}
_KEYS |= {"holders", "classes", "dim", "clients", "digests", "stored_at", "excluded"}
_KEYS |= {"statistics", "retract", "retraction"}
_COLLECT_KEYS = {"v", "type", "fleet", "run", "round", "worker", "exclude", "retract"}


def partial_topic(fleet: str, worker: str) -> str:
    return f"{TIER_ROOT}/{validate_id(fleet, field='fleet')}/partial/{validate_id(worker, field='worker')}"


def partial_filter(fleet: str) -> str:
    return f"{TIER_ROOT}/{validate_id(fleet, field='fleet')}/partial/+"


def collect_topic(fleet: str) -> str:
    """Where the combiner asks the workers for their partial sums of a round."""
    return f"{TIER_ROOT}/{validate_id(fleet, field='fleet')}/collect"


@dataclass(frozen=True)
class Copy:
    """One worker's stored copy of a client's update: the SHA-256 of its payload (what
    the device's receipt names) and when the worker committed it (Unix seconds)."""

    digest: str
    stored_at: float

    def __post_init__(self) -> None:
        if len(self.digest) != 2 * DIGEST_BYTES or any(
            c not in "0123456789abcdef" for c in self.digest
        ):
            raise ValueError("a digest is 64 lowercase hex digits")
        if not np.isfinite(self.stored_at):
            raise ValueError("stored_at must be finite")


@dataclass(frozen=True)
class CollectRequest:
    """The combiner asks for the partial sums of ``round`` of ``run``: every worker's
    (``worker`` None) or one worker's, leaving out the clients in ``exclude``, and with
    the summed statistics of the earlier copies in ``retract`` (client -> the round of
    the copy, before ``round``; closed-form methods).

    A worker that answers a request takes no more updates for that round: its partial of
    the round is final from then on, so a receipt it sent is for an update the merge holds.
    """

    fleet: str
    run: str
    round: int
    worker: str | None = None
    exclude: frozenset[str] = frozenset()
    # hash=False: a mapping is not hashable; equality still compares it.
    retract: Mapping[str, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        validate_id(self.fleet, field="fleet")
        validate_id(self.run, field="run")
        if not 0 <= self.round <= MAX_ROUND:
            raise ValueError(f"round must be in 0..{MAX_ROUND}")
        if self.worker is not None:
            validate_id(self.worker, field="worker")
        for client in self.exclude:
            validate_id(client, field="exclude")
        if (self.exclude or self.retract) and self.worker is None:
            raise ValueError("clients are excluded from one worker's partial, not every one's")
        object.__setattr__(self, "retract", checked_retract(self.retract, self.round))

    def to_wire(self) -> bytes:
        return pack(
            {
                "v": VERSION,
                "type": "collect",
                "fleet": self.fleet,
                "run": self.run,
                "round": self.round,
                "worker": self.worker,
                "exclude": sorted(self.exclude),
                "retract": dict(sorted(self.retract.items())),
            }
        )

    @classmethod
    def from_wire(cls, payload: object, *, max_bytes: int = MAX_COLLECT_BYTES) -> CollectRequest:
        """Decode and check a request; any problem is a ``MalformedPayload``."""
        obj = unpack(payload, max_bytes=max_bytes)
        if set(obj) != _COLLECT_KEYS or obj["v"] != VERSION or obj["type"] != "collect":
            raise MalformedPayload(f"not a version {VERSION} collect request")
        worker, exclude = obj["worker"], strings_field(obj, "exclude")
        if worker is not None and not isinstance(worker, str):
            raise MalformedPayload("must be a worker id or nil", field="worker")
        try:
            return cls(
                fleet=id_field(obj, "fleet"),
                run=id_field(obj, "run"),
                round=int_field(obj, "round", 0, MAX_ROUND),
                worker=worker,
                exclude=frozenset(exclude),
                retract=rounds_field(obj, "retract"),
            )
        except ValueError as exc:
            raise MalformedPayload(f"bad collect request: {exc}") from exc

    def addressed_to(self, worker: str) -> bool:
        return self.worker is None or self.worker == worker


@dataclass(frozen=True)
class PartialMessage:
    """One worker's partial sum of ``round`` of ``run``; ``copies`` says, for each client
    the sum covers, which copy of its update it holds; ``excluded`` and ``retract`` echo
    the request. Closed-form methods: ``statistics`` sums the statistics of the updates
    that carry some (a subset of the partial's clients), ``retraction`` those of the
    earlier copies ``retract`` names that the worker holds (None when it names none)."""

    fleet: str
    run: str
    round: int
    worker: str
    partial: PartialSum
    copies: Mapping[str, Copy] = field(default_factory=dict)
    excluded: frozenset[str] = frozenset()
    statistics: StatisticsPart | None = None
    retract: Mapping[str, int] = field(default_factory=dict)
    retraction: StatisticsPart | None = None

    def __post_init__(self) -> None:
        if set(self.copies) != self.partial.clients:
            raise ValueError("copies must name exactly the partial sum's clients")
        if self.excluded & self.partial.clients:
            raise ValueError("an excluded client is in the partial sum")
        shape = (self.partial.num_classes, self.partial.dim)
        for part in (self.statistics, self.retraction):
            if part is not None and (part.stats.num_classes, part.stats.dim) != shape:
                raise ValueError(f"statistics of another shape than the partial sum's {shape}")
        if self.statistics is not None and not self.statistics.clients <= self.partial.clients:
            raise ValueError("statistics of a client the partial sum does not hold")
        if (self.retraction is None) != (not self.retract):
            raise ValueError("a retraction answers a request that names earlier copies, only")
        if self.retraction is not None and not self.retraction.clients <= set(self.retract):
            raise ValueError("a retraction of a client the request did not name")
        object.__setattr__(self, "copies", MappingProxyType(dict(self.copies)))
        object.__setattr__(self, "retract", checked_retract(self.retract, self.round))

    def to_wire(self) -> bytes:
        p = self.partial
        clients = sorted(p.clients)
        return pack(
            {
                "v": VERSION,
                "type": "partial",
                "fleet": self.fleet,
                "run": self.run,
                "round": self.round,
                "worker": self.worker,
                "classes": p.num_classes,
                "dim": p.dim,
                "weighted": np.ascontiguousarray(p.weighted, "<f8").tobytes(),
                "counts": np.ascontiguousarray(p.counts, "<f8").tobytes(),
                "plain": np.ascontiguousarray(p.plain, "<f8").tobytes(),
                "holders": np.ascontiguousarray(p.holders, "<i8").tobytes(),
                "clients": clients,
                "digests": b"".join(bytes.fromhex(self.copies[c].digest) for c in clients),
                "stored_at": np.array(
                    [self.copies[c].stored_at for c in clients], dtype="<f8"
                ).tobytes(),
                "excluded": sorted(self.excluded),
                "statistics": part_fields(self.statistics),
                "retract": dict(sorted(self.retract.items())),
                "retraction": part_fields(self.retraction),
            }
        )

    @classmethod
    def from_wire(cls, payload: object, *, max_bytes: int = MAX_PARTIAL_BYTES) -> PartialMessage:
        """Decode and check a partial; any problem is a ``MalformedPayload``."""
        obj = unpack(payload, max_bytes=max_bytes)
        if set(obj) != _KEYS or obj["v"] != VERSION or obj["type"] != "partial":
            raise MalformedPayload(f"not a version {VERSION} partial sum")
        c, d = int_field(obj, "classes", 1, MAX_CLASSES), int_field(obj, "dim", 1, MAX_DIM)
        clients, excluded = strings_field(obj, "clients"), strings_field(obj, "excluded")
        n = len(clients)
        digests = blob_field(obj, "digests", n * DIGEST_BYTES)
        stored_at = array_field(obj, "stored_at", "<f8", (n,))
        statistics = part_from(obj["statistics"], "statistics", c, d)
        retraction = part_from(obj["retraction"], "retraction", c, d)
        try:
            for client in (*clients, *excluded):
                validate_id(client, field="clients")
            partial = PartialSum(
                weighted=array_field(obj, "weighted", "<f8", (c, d)),
                counts=array_field(obj, "counts", "<f8", (c,)),
                plain=array_field(obj, "plain", "<f8", (c, d)),
                holders=array_field(obj, "holders", "<i8", (c,)),
                clients=frozenset(clients),
            )
            if len(partial.clients) != n:
                raise ValueError("a client is listed twice")
            copies = {
                client: Copy(
                    digest=digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES].hex(),
                    stored_at=float(stored_at[i]),
                )
                for i, client in enumerate(clients)
            }
            return cls(
                fleet=id_field(obj, "fleet"),
                run=id_field(obj, "run"),
                round=int_field(obj, "round", 0, MAX_ROUND),
                worker=id_field(obj, "worker"),
                partial=partial,
                copies=copies,
                excluded=frozenset(excluded),
                statistics=statistics,
                retract=rounds_field(obj, "retract"),
                retraction=retraction,
            )
        except ValueError as exc:  # the ids', PartialSum's and Copy's own checks
            raise MalformedPayload(f"bad partial sum: {exc}") from exc


def exclusions(messages: Iterable[PartialMessage]) -> dict[str, frozenset[str]]:
    """For each worker, the clients to leave out of its partial so that the partials
    cover every client once: ``{}`` when they share none.

    Of a client's copies, the one kept is the worker's whose id sorts first when every
    copy has one digest (a resend: the copies are equal, and the choice must not depend on
    the workers' clocks); when the copies differ, the one stored first, by the storing
    workers' clocks (ties to the worker id sorting first): the coordinator's own rule,
    first stored wins, as closely as separate clocks can tell it.
    """
    holders: dict[str, list[PartialMessage]] = {}
    for m in messages:
        for client in m.partial.clients:
            holders.setdefault(client, []).append(m)
    out: dict[str, set[str]] = {}
    for client, held in holders.items():
        if len(held) < 2:
            continue
        if len({m.copies[client].digest for m in held}) == 1:
            keep = min(held, key=lambda m: m.worker)
        else:
            keep = min(held, key=lambda m: (m.copies[client].stored_at, m.worker))
        for m in held:
            if m is not keep:
                out.setdefault(m.worker, set()).add(client)
    return {worker: frozenset(clients) for worker, clients in sorted(out.items())}


def combine(messages: Iterable[PartialMessage], *, fleet: str, run: str, round_: int) -> PartialSum:
    """The round's partial sum over every worker's: refuses another fleet's, run's or
    round's message, two from one worker, and (through :func:`merge`) a client counted
    twice; :func:`exclusions` says which clients to ask the workers to leave out first."""
    batch = list(messages)
    stray = [m.worker for m in batch if (m.fleet, m.run, m.round) != (fleet, run, round_)]
    if stray:
        raise ValueError(f"partials of another fleet, run or round from {', '.join(stray)}")
    workers = [m.worker for m in batch]
    if len(set(workers)) != len(workers):
        raise ValueError("two partial sums from one worker")
    return merge(m.partial for m in batch)
