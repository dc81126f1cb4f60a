"""msgpack framing: the only place raw bytes become Python objects and back.

Decoding is strict: a byte cap is checked before msgpack sees the payload, extension
types (including msgpack timestamps) are refused, and every failure of the msgpack library
is re-raised as :class:`~protocol.errors.MalformedPayload`.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack

from protocol.errors import MalformedPayload, PayloadTooLarge
from protocol.limits import DEFAULT_MAX_PAYLOAD_BYTES


def _refuse_ext(code: int, data: bytes) -> Any:
    raise MalformedPayload(f"msgpack extension type {code} is not allowed")


_local = threading.local()


def pack(obj: dict[str, Any]) -> bytes:
    # msgpack.packb allocates a fresh Packer and its buffer per call, which costs as much
    # as encoding a whole prototype set; one Packer per thread halves the encode time.
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    return packer.pack(obj)


def check_size(payload: object, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> bytes:
    """Return ``payload`` as bytes if it is a byte string within ``max_bytes``."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise MalformedPayload(f"payload must be bytes, got {type(payload).__name__}")
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if size > max_bytes:
        raise PayloadTooLarge(f"{size} bytes exceeds the cap of {max_bytes}")
    return bytes(payload)


def unpack(payload: object, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> dict[str, Any]:
    """Decode a payload whose top level must be a map with string keys."""
    data = check_size(payload, max_bytes=max_bytes)
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext
        )
    except MalformedPayload:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # msgpack signals truncation, trailing bytes, bad UTF-8, unhashable keys and
        # too-deep nesting with a variety of ValueError/TypeError subclasses.
        raise MalformedPayload(f"not valid msgpack: {exc}") from exc
    if not isinstance(obj, dict):
        raise MalformedPayload(f"top level must be a map, got {type(obj).__name__}")
    return obj
