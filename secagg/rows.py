"""The rows the secure-aggregation messages are built of: byte strings of a set size,
lists of distinct device ids, maps and tables keyed by device id. Collections keyed by a
device travel as lists of rows, ``[id, ...]``, not msgpack maps: a map that names a device
twice decodes silently to its last entry, while a list keeps the duplicate for the check
to refuse."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from protocol import fields as f
from protocol.errors import FieldError
from protocol.ids import validate_id
from protocol.limits import MAX_CLIENTS


def blob(value: object, *, field: str, size: int | None = None) -> bytes:
    """``value`` if it is a byte string (of exactly ``size`` bytes when given)."""
    if type(value) is not bytes:
        raise FieldError(f"expected bytes, got {type(value).__name__}", field=field)
    if size is not None and len(value) != size:
        raise FieldError(f"expected {size} bytes, got {len(value)}", field=field)
    return value


def ids(value: object, *, field: str) -> tuple[str, ...]:
    """A non-empty list of distinct device ids."""
    items = f.sequence(value, field=field, max_length=MAX_CLIENTS)
    if not items:
        raise FieldError("must not be empty", field=field)
    return f.unique(tuple(validate_id(c, field=field) for c in items), field=field)


def id_map(value: object, *, field: str) -> Mapping[str, Any]:
    """A read-only map from device ids, sorted by id so that equal maps encode alike."""
    items = f.mapping(value, field=field, max_length=MAX_CLIENTS)
    for key in items:
        validate_id(key, field=f"{field}.key")
    return MappingProxyType(dict(sorted(items.items())))


def table(value: object, *, field: str, width: int) -> list[tuple[Any, ...]]:
    """Rows ``[id, ...]`` of ``width`` entries, no id twice."""
    rows = f.sequence(value, field=field, max_length=MAX_CLIENTS)
    out = []
    for row in rows:
        cells = f.sequence(row, field=field, max_length=width)
        if len(cells) != width:
            raise FieldError(f"expected rows of {width} entries", field=field)
        out.append(cells)
    f.unique(tuple(validate_id(row[0], field=f"{field}.key") for row in out), field=field)
    return out
