"""Strict field readers shared by the message decoders and the dataclass validators.

Each reader checks one field's type and range and raises a :class:`FieldError` naming it.
``bool`` is never accepted where a number is expected (it is an ``int`` subclass in Python).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from protocol.errors import FieldError, MalformedPayload, UnsupportedVersion
from protocol.limits import MAX_TEXT_LENGTH, PROTOCOL_VERSION

Scalar = bool | int | float | str


def integer(value: object, *, field: str, low: int = 0, high: int = 2**31 - 1) -> int:
    if type(value) is not int:
        raise FieldError(f"expected an integer, got {type(value).__name__}", field=field)
    if not low <= value <= high:
        raise FieldError(f"{value} is outside [{low}, {high}]", field=field)
    return value


def number(value: object, *, field: str, low: float | None = None) -> float:
    if type(value) not in (int, float):
        raise FieldError(f"expected a number, got {type(value).__name__}", field=field)
    # Integers stay integers: an integral count costs 1-3 bytes on the wire, a float 9.
    result: float = value  # type: ignore[assignment]
    if not math.isfinite(result):
        raise FieldError("must be finite", field=field)
    if low is not None and result < low:
        raise FieldError(f"{result} is below {low}", field=field)
    return result


def optional_number(value: object, *, field: str, low: float | None = None) -> float | None:
    return None if value is None else number(value, field=field, low=low)


def text(
    value: object, *, field: str, max_length: int = MAX_TEXT_LENGTH, empty: bool = True
) -> str:
    if not isinstance(value, str):
        raise FieldError(f"expected a string, got {type(value).__name__}", field=field)
    if len(value) > max_length:
        raise FieldError(f"longer than {max_length} characters", field=field)
    if not empty and not value:
        raise FieldError("must not be empty", field=field)
    if "\x00" in value:
        raise FieldError("must not contain NUL", field=field)
    return value


def scalar(value: object, *, field: str) -> Scalar:
    if type(value) is bool:
        return bool(value)
    if type(value) in (int, float):
        number(value, field=field)
        return value  # type: ignore[return-value]
    return text(value, field=field)


def sequence(value: object, *, field: str, max_length: int) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise FieldError(f"expected a list, got {type(value).__name__}", field=field)
    if len(value) > max_length:
        raise FieldError(f"more than {max_length} entries", field=field)
    return tuple(value)


def mapping(value: object, *, field: str, max_length: int) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise FieldError(f"expected a map, got {type(value).__name__}", field=field)
    if len(value) > max_length:
        raise FieldError(f"more than {max_length} entries", field=field)
    return value


def unique(values: tuple[Any, ...], *, field: str) -> tuple[Any, ...]:
    if len(set(values)) != len(values):
        raise FieldError("entries must be unique", field=field)
    return values


class Envelope:
    """The decoded top-level map of one message, read field by field.

    Construction checks the protocol version (one of ``versions``, kept as
    :attr:`version`) and message type; :meth:`finish` raises if the map held fields the
    message does not define.
    """

    def __init__(
        self, obj: dict[str, Any], *, kind: str, versions: tuple[int, ...] = (PROTOCOL_VERSION,)
    ) -> None:
        version = obj.get("v")
        if version is None:
            raise FieldError("missing field", field="v")
        if type(version) is not int or version not in versions:
            raise UnsupportedVersion(
                f"protocol version {version!r} is not supported "
                f"(this side speaks {' and '.join(map(str, versions))})",
                field="v",
                version=version if type(version) is int else None,
            )
        self.version: int = version
        if obj.get("type") != kind:
            raise MalformedPayload(
                f"expected a {kind!r} message, got {obj.get('type')!r}", field="type"
            )
        self._obj = obj
        self._seen = {"v", "type"}

    def take(self, name: str) -> Any:
        if name not in self._obj:
            raise FieldError("missing field", field=name)
        self._seen.add(name)
        return self._obj[name]

    def take_optional(self, name: str) -> Any:
        """A field that may be absent from the wire (``auth``: unsigned messages keep
        the encoding they had before signatures existed)."""
        self._seen.add(name)
        return self._obj.get(name)

    def finish(self) -> None:
        unknown = sorted(set(self._obj) - self._seen)
        if unknown:
            raise FieldError(f"unknown field(s) {unknown}", field=unknown[0])
