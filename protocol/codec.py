"""msgpack framing: the only place raw bytes become Python objects and back.

Decoding is strict: a byte cap is checked before msgpack sees the payload, extension
types (including msgpack timestamps) are refused, and every failure of the msgpack library
is re-raised as :class:`~protocol.errors.MalformedPayload`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import MalformedPayload, PayloadTooLarge
from protocol.limits import DEFAULT_MAX_PAYLOAD_BYTES


def _refuse_ext(code: int, data: bytes) -> Any:
    raise MalformedPayload(f"msgpack extension type {code} is not allowed")


_local = threading.local()


@dataclass(frozen=True, slots=True)
class Packed:
    """A top-level field's value already in msgpack form, which :func:`pack` splices in
    as it stands: the bytes are those packing the value would give. For a value many
    messages share: the secure-aggregation roster's 10,000 ids went to each of 10,000
    devices, 6.5 s of the coordinator's round packing the same list again and again."""

    data: bytes


def pack(obj: dict[str, Any]) -> bytes:
    # msgpack.packb allocates a fresh Packer and its buffer per call, which costs as much
    # as encoding a whole prototype set; one Packer per thread halves the encode time.
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    if not any(type(v) is Packed for v in obj.values()):
        return packer.pack(obj)
    # A map is its header, then each key's and value's encoding in order: the same bytes.
    parts = [packer.pack_map_header(len(obj))]
    for key, value in obj.items():
        parts += (packer.pack(key), value.data if type(value) is Packed else packer.pack(value))
    return b"".join(parts)


def packed(value: Any) -> Packed:
    """``value`` packed once, to splice into many messages (:class:`Packed`)."""
    return Packed(msgpack.packb(value, use_bin_type=True))


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
