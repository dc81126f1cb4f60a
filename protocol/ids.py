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
#: Ids already found safe (their length aside): a secure round of 10,000 devices checks
#: the same ids millions of times, each message naming its 200 neighbours. Bounded: it
#: empties when full, so hostile traffic of fresh ids costs memory no more than this.
_SAFE_SEEN: dict[str, None] = {}
_SAFE_SEEN_MAX = 1 << 17


def validate_id(value: object, *, field: str, max_length: int = MAX_ID_LENGTH) -> str:
    """Return ``value`` if it is a safe identifier, else raise :class:`InvalidId`."""
    if type(value) is str and value in _SAFE_SEEN and len(value) <= max_length:
        return value
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
    if type(value) is str:  # a subclass could compare equal yet behave otherwise
        if len(_SAFE_SEEN) >= _SAFE_SEEN_MAX:
            _SAFE_SEEN.clear()
        _SAFE_SEEN[value] = None
    return value


def is_valid_id(value: object, *, max_length: int = MAX_ID_LENGTH) -> bool:
    try:
        validate_id(value, field="id", max_length=max_length)
    except InvalidId:
        return False
    return True
