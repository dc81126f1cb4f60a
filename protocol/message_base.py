"""What every protocol message shares: the wire plumbing and the field checks.

A message is a frozen dataclass deriving from :class:`WireMessage`; it says how its fields
become a msgpack map (``_body``) and back (``_from_envelope``), and this module adds the
envelope (version, kind, signature), the size limit and value equality. The helpers below
validate the field shapes several messages carry (array maps, the signature, the round's
identifying fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import numpy as np

from protocol import fields as f
from protocol.arrays import FloatArray, check_array, decode_array, encode_array
from protocol.auth import Auth
from protocol.codec import pack, unpack
from protocol.errors import FieldError
from protocol.ids import validate_id
from protocol.limits import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_BUNDLE_ID_LENGTH,
    MAX_METHOD_LENGTH,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
)

M = TypeVar("M", bound="WireMessage")


def freeze(obj: object, name: str, value: object) -> None:
    """Store a validated (normalised) value on a frozen dataclass from ``__post_init__``."""
    object.__setattr__(obj, name, value)


def array_map(
    value: object, *, field: str, max_length: int, ndim: int | None = None
) -> Mapping[str, FloatArray]:
    items = f.mapping(value, field=field, max_length=max_length)
    checked = {
        validate_id(key, field=f"{field}.key"): check_array(arr, field=f"{field}.{key}", ndim=ndim)
        for key, arr in sorted(items.items(), key=lambda kv: str(kv[0]))
    }
    return MappingProxyType(checked)


def decode_array_map(value: object, *, field: str, max_length: int) -> dict[str, FloatArray]:
    items = f.mapping(value, field=field, max_length=max_length)
    return {
        validate_id(key, field=f"{field}.key"): decode_array(arr, field=f"{field}.{key}")
        for key, arr in items.items()
    }


def encode_array_map(value: Mapping[str, FloatArray]) -> dict[str, Any]:
    return {key: encode_array(arr) for key, arr in value.items()}


class WireMessage:
    """Shared wire plumbing. Subclasses define ``KIND``, ``_body`` and ``_from_envelope``.

    ``VERSIONS``: the protocol versions the message is read in. A message that has a
    ``wire_version`` field is written in that version (the one it was read in, or
    :data:`PROTOCOL_VERSION`); the others always in :data:`PROTOCOL_VERSION`."""

    KIND: ClassVar[str]
    VERSIONS: ClassVar[tuple[int, ...]] = (PROTOCOL_VERSION,)

    def to_wire(self) -> bytes:
        body = self._body()
        auth = getattr(self, "auth", None)
        if auth is not None:  # absent, not nil, when unsigned: see protocol/auth.py
            body["auth"] = auth.to_obj()
        body["v"] = getattr(self, "wire_version", PROTOCOL_VERSION)
        body["type"] = self.KIND
        return pack(body)

    @classmethod
    def from_wire(
        cls: type[M], payload: object, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    ) -> M:
        envelope = f.Envelope(
            unpack(payload, max_bytes=max_bytes),
            kind=cls.KIND,
            versions=cls.VERSIONS,
        )
        message = cls._from_envelope(envelope)
        envelope.finish()
        return message

    def _body(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_envelope(cls: type[M], env: f.Envelope) -> M:
        raise NotImplementedError

    # Arrays make the generated __eq__ ambiguous; compare them by dtype, shape and value.
    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(
            values_equal(getattr(self, fl.name), getattr(other, fl.name))
            for fl in dataclasses.fields(self)  # type: ignore[arg-type]
        )

    __hash__ = None  # type: ignore[assignment]


def values_equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    return a == b


def check_wire_version(obj: Any) -> None:
    if type(obj.wire_version) is not int or obj.wire_version not in SUPPORTED_VERSIONS:
        raise FieldError(f"{obj.wire_version!r} is not a supported version", field="v")


def legacy_run(auth: Auth | None) -> str:
    """The run of a version-2 message, which has no run field: the run its signature names
    (``""`` when unsigned), so that a signature is still checked for the run it covers."""
    return "" if auth is None else auth.run


def check_auth(obj: Any) -> None:
    if obj.auth is not None and not isinstance(obj.auth, Auth):
        raise FieldError("expected Auth", field="auth")


def take_auth(env: f.Envelope) -> Auth | None:
    obj = env.take_optional("auth")
    return None if obj is None else Auth.from_obj(obj)


def check_round_fields(obj: Any) -> None:
    """Check the fields that place a message in a round: fleet, round, bundle, method."""
    validate_id(obj.fleet, field="fleet")
    f.integer(obj.round, field="round")
    f.text(obj.bundle, field="bundle", max_length=MAX_BUNDLE_ID_LENGTH, empty=False)
    validate_id(obj.method, field="method", max_length=MAX_METHOD_LENGTH)
