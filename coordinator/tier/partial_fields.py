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


def statistics_from(obj: object, *, num_classes: int, dim: int) -> cf.Statistics:
    """Summed statistics in the project's one encoding (closed_form/encoding.py), checked;
    any problem is a ``MalformedPayload``."""
    try:
        return cf.statistics_from(obj, num_classes=num_classes, dim=dim)
    except ValueError as exc:
        raise MalformedPayload(f"bad statistics: {exc}") from exc


def part_fields(part: StatisticsPart | None) -> dict[str, Any] | None:
    if part is None:
        return None
    return {**cf.statistics_fields(part.stats), "clients": sorted(part.clients)}


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
