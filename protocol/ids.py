"""Identifier validation.

Fleet ids, client ids and array names end up inside MQTT topics and broker ACL patterns.
Restricting them to a small alphabet means an id can never contain a wildcard (``+``, ``#``),
a level separator (``/``) or a NUL, so it can never widen a subscription or escape an ACL.
"""

from __future__ import annotations

import re

from protocol.errors import InvalidId
from protocol.limits import MAX_ID_LENGTH

_SAFE = re.compile(r"[A-Za-z0-9_.\-]+")


def validate_id(value: object, *, field: str, max_length: int = MAX_ID_LENGTH) -> str:
    """Return ``value`` if it is a safe identifier, else raise :class:`InvalidId`."""
    if not isinstance(value, str):
        raise InvalidId(f"expected a string, got {type(value).__name__}", field=field)
    if not value:
        raise InvalidId("must not be empty", field=field)
    if len(value) > max_length:
        raise InvalidId(f"longer than {max_length} characters", field=field)
    if _SAFE.fullmatch(value) is None:
        raise InvalidId(
            f"{value!r} may only contain letters, digits, '-', '_' and '.'", field=field
        )
    if value in {".", ".."}:
        # Would be harmless in MQTT but ids also name state directories on disk.
        raise InvalidId(f"{value!r} is reserved", field=field)
    return value


def is_valid_id(value: object, *, max_length: int = MAX_ID_LENGTH) -> bool:
    try:
        validate_id(value, field="id", max_length=max_length)
    except InvalidId:
        return False
    return True
