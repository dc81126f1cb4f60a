"""Exceptions raised by the wire protocol.

Every decoding failure is a :class:`ProtocolError` naming the offending field, so a
consumer can count rejections by reason without parsing messages.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """Base of every error raised while building, encoding or decoding a message."""

    reason = "invalid"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        prefix = f"{field}: " if field else ""
        super().__init__(prefix + message)


class PayloadTooLarge(ProtocolError):
    """The raw payload exceeds the configured byte cap; it was never decoded."""

    reason = "too_large"


class MalformedPayload(ProtocolError):
    """The bytes are not a msgpack map of the expected shape."""

    reason = "malformed"


class UnsupportedVersion(ProtocolError):
    """The message carries a protocol version this code does not speak (``version``: the
    one it carries, None when it is not an integer)."""

    reason = "version"

    def __init__(self, message: str, *, field: str | None = None, version: int | None = None):
        super().__init__(message, field=field)
        self.version = version


class FieldError(ProtocolError):
    """A field is missing, unknown, of the wrong type or out of range."""

    reason = "field"


class ArrayError(ProtocolError):
    """An array field has a bad dtype, shape, byte length or non-finite values."""

    reason = "array"


class InvalidId(ProtocolError):
    """A fleet, client or extra-array name is outside the safe alphabet or too long."""

    reason = "id"


class TopicError(ProtocolError):
    """A topic string is not one of the protocol's topics."""

    reason = "topic"
