"""The rows the secure-aggregation messages are built of: byte strings of a set size,
lists of distinct device ids, maps and tables keyed by device id. Collections keyed by a
device travel as lists of rows, ``[id, ...]``, not msgpack maps: a map that names a device
twice decodes silently to its last entry, while a list keeps the duplicate for the check
to refuse."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from protocol import fields as f
from protocol.codec import Packed, packed
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
        # msgpack decodes a row as a list: checked here without a call a row (a message
        # holds 200 rows, and a coordinator of 10,000 devices reads 50,000 messages).
        if type(row) is not list or len(row) != width:
            row = f.sequence(row, field=field, max_length=width)
            if len(row) != width:
                raise FieldError(f"expected rows of {width} entries", field=field)
        out.append(tuple(row))
    keys = [validate_id(row[0], field=f"{field}.key") for row in out]
    if len(set(keys)) != len(keys):
        raise FieldError("entries must be unique", field=field)
    return out


#: The last roster list checked (its ids, as a set) and the last packed, each with the
#: tuple it came from: the coordinator builds every device's roster from one tuple, 10,000
#: ids checked 10,000 times otherwise (32 s), and packed as often (6.5 s).
_CHECKED: list[tuple[object, tuple[tuple[str, ...], frozenset[str]]]] = []
_PACKED: list[tuple[object, Packed]] = []
T = TypeVar("T")


def _once_per_tuple(cache: list[tuple[object, T]], value: object, make: Callable[[Any], T]) -> T:
    """``make(value)``, reused while ``value`` is the same tuple object (a tuple cannot
    change, so what was made of it stands)."""
    last = cache[0] if cache else None  # one read: another thread may replace it
    if last is not None and last[0] is value:
        return last[1]
    made = make(value)
    if type(value) is tuple:
        cache[:] = [(value, made)]
    return made


def _checked_roster(value: object) -> tuple[tuple[str, ...], frozenset[str]]:
    clients = ids(value, field="clients")
    if list(clients) != sorted(clients):
        raise FieldError("must be sorted", field="clients")
    return clients, frozenset(clients)


def roster_ids(value: object) -> tuple[tuple[str, ...], frozenset[str]]:
    """A roster's ``clients``: distinct valid ids, sorted, and their set; checked once per
    tuple object."""
    return _once_per_tuple(_CHECKED, value, _checked_roster)


def packed_ids(clients: tuple[str, ...]) -> Packed:
    """A roster's list in its wire form, packed once per tuple object."""
    return _once_per_tuple(_PACKED, clients, lambda c: packed(list(c)))
