"""The fields of the worker tier's messages (coordinator/tier/partial_wire.py), each checked as
it is read: integers in range, ids, strings, blobs and arrays of the fleet's shapes, and
the closed-form statistics a partial carries (one map of arrays, float64 little-endian)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

import closed_form as cf
from coordinator.tier.partial_statistics import StatisticsPart
from protocol.errors import MalformedPayload
from protocol.ids import validate_id

STATISTICS_KEYS = {"counts", "sums", "gram", "scatter", "holders", "devices"}


#: A sum over at most this many devices (float64 integers are exact below 2**53).
MAX_DEVICES = 2**53


def int_field(obj: dict[str, Any], key: str, low: int, high: int) -> int:
    value = obj[key]
    if type(value) is not int or not low <= value <= high:
        raise MalformedPayload(f"must be an integer in {low}..{high}", field=key)
    return value


def id_field(obj: dict[str, Any], key: str) -> str:
    try:
        return validate_id(obj[key], field=key)
    except ValueError as exc:
        raise MalformedPayload(f"bad {key}: {exc}", field=key) from exc


def strings_field(obj: dict[str, Any], key: str) -> list[str]:
    value = obj[key]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise MalformedPayload("must be a list of strings", field=key)
    return value


def blob_field(obj: dict[str, Any], key: str, size: int) -> bytes:
    data = obj[key]
    if not isinstance(data, bytes) or len(data) != size:
        raise MalformedPayload(f"must be {size} bytes", field=key)
    return data


def array_field(obj: dict[str, Any], key: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    data = blob_field(obj, key, int(np.prod(shape)) * 8)
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype[1:])


def checked_retract(retract: Mapping[str, int], round_: int) -> Mapping[str, int]:
    """``retract`` checked (ids, earlier rounds) and frozen."""
    for client, earlier in retract.items():
        validate_id(client, field="retract")
        if type(earlier) is not int or not 0 <= earlier < round_:
            raise ValueError(f"the earlier copy of {client} must be of a round before {round_}")
    return MappingProxyType(dict(retract))


def rounds_field(obj: dict[str, Any], key: str) -> dict[str, int]:
    value = obj[key]
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in value.items()
    ):
        raise MalformedPayload("must be a map of client ids to rounds", field=key)
    return value


def statistics_fields(stats: cf.Statistics) -> dict[str, Any]:
    """Summed closed-form statistics as msgpack fields: raw little-endian float64 (int64
    for ``holders``), the second moment as its upper triangle, and FedCOF's scatter whole.
    Also the owner's form on disk (coordinator/tier/owner_statistics.py)."""
    gram = None if stats.gram is None else cf.upper_triangle(stats.gram)
    return {
        "counts": f8_bytes(stats.counts),
        "sums": f8_bytes(stats.sums),
        "gram": None if gram is None else f8_bytes(gram),
        "scatter": None if stats.scatter is None else f8_bytes(stats.scatter),
        "holders": np.ascontiguousarray(stats.holders, "<i8").tobytes(),
        "devices": stats.devices,
    }


def f8_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, "<f8").tobytes()


def statistics_from(obj: object, *, num_classes: int, dim: int) -> cf.Statistics:
    """The statistics of :func:`statistics_fields` for ``num_classes`` x ``dim``, checked:
    every key and length, exactly one of a second moment and a scatter, finite values,
    holders within the devices. Any problem is a ``MalformedPayload``."""
    if not isinstance(obj, dict) or set(obj) != STATISTICS_KEYS:
        raise MalformedPayload(f"statistics must be a map of {sorted(STATISTICS_KEYS)}")
    c, d = num_classes, dim
    if (obj["gram"] is None) == (obj["scatter"] is None):
        raise MalformedPayload("statistics carry a second moment or a scatter", field="gram")
    triangle = (d * (d + 1) // 2,)
    try:
        gram = None if obj["gram"] is None else array_field(obj, "gram", "<f8", triangle)
        scatter = None if obj["scatter"] is None else array_field(obj, "scatter", "<f8", (c, d, d))
        return cf.Statistics(
            counts=array_field(obj, "counts", "<f8", (c,)),
            sums=array_field(obj, "sums", "<f8", (c, d)),
            gram=None if gram is None else cf.from_upper_triangle(gram),
            scatter=scatter,
            holders=array_field(obj, "holders", "<i8", (c,)),
            devices=int_field(obj, "devices", 0, MAX_DEVICES),
        )
    except ValueError as exc:  # Statistics' own checks: finite, holders within devices
        raise MalformedPayload(f"bad statistics: {exc}") from exc


def part_fields(part: StatisticsPart | None) -> dict[str, Any] | None:
    if part is None:
        return None
    return {**statistics_fields(part.stats), "clients": sorted(part.clients)}


def part_from(obj: object, key: str, c: int, d: int) -> StatisticsPart | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or "clients" not in obj:
        raise MalformedPayload("must be nil or a map of summed statistics", field=key)
    fields = {k: v for k, v in obj.items() if k != "clients"}
    clients = strings_field(obj, "clients")
    stats = statistics_from(fields, num_classes=c, dim=d)
    try:
        for client in clients:
            validate_id(client, field=key)
        if len(set(clients)) != len(clients):
            raise ValueError("a client is listed twice")
        return StatisticsPart(stats=stats, clients=frozenset(clients))
    except ValueError as exc:
        raise MalformedPayload(f"bad {key}: {exc}", field=key) from exc
