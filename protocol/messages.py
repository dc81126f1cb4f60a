"""The three protocol messages as frozen, self-validating dataclasses.

Nothing outside this module touches raw msgpack maps: producers build a message and call
``to_wire()``; consumers call ``from_wire(payload)``, which either returns a valid message
or raises a :class:`~protocol.errors.ProtocolError` naming the field. Every field is always
present on the wire (``nil`` for an absent optional value) so that a missing field is an
error rather than a silent default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
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
    MAX_CLASSES,
    MAX_CLIENTS,
    MAX_EXTRAS,
    MAX_GUARANTEE_LENGTH,
    MAX_ID_LENGTH,
    MAX_METHOD_LENGTH,
    MAX_PARAMS,
    PROTOCOL_VERSION,
)

M = TypeVar("M", bound="_Message")


def _freeze(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


def _array_map(
    value: object, *, field: str, max_length: int, ndim: int | None = None
) -> Mapping[str, FloatArray]:
    items = f.mapping(value, field=field, max_length=max_length)
    checked = {
        validate_id(key, field=f"{field}.key"): check_array(arr, field=f"{field}.{key}", ndim=ndim)
        for key, arr in sorted(items.items(), key=lambda kv: str(kv[0]))
    }
    return MappingProxyType(checked)


def _decode_array_map(value: object, *, field: str, max_length: int) -> dict[str, FloatArray]:
    items = f.mapping(value, field=field, max_length=max_length)
    return {
        validate_id(key, field=f"{field}.key"): decode_array(arr, field=f"{field}.{key}")
        for key, arr in items.items()
    }


def _encode_array_map(value: Mapping[str, FloatArray]) -> dict[str, Any]:
    return {key: encode_array(arr) for key, arr in value.items()}


class _Message:
    """Shared wire plumbing. Subclasses define ``KIND``, ``_body`` and ``_from_envelope``."""

    KIND: ClassVar[str]

    def to_wire(self) -> bytes:
        body = self._body()
        auth = getattr(self, "auth", None)
        if auth is not None:  # absent, not nil, when unsigned: see protocol/auth.py
            body["auth"] = auth.to_obj()
        body["v"] = PROTOCOL_VERSION
        body["type"] = self.KIND
        return pack(body)

    @classmethod
    def from_wire(
        cls: type[M], payload: object, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    ) -> M:
        envelope = f.Envelope(unpack(payload, max_bytes=max_bytes), kind=cls.KIND)
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
            _values_equal(getattr(self, fl.name), getattr(other, fl.name))
            for fl in dataclasses.fields(self)  # type: ignore[arg-type]
        )

    __hash__ = None  # type: ignore[assignment]


def _values_equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    return a == b


@dataclass(frozen=True, eq=False)
class PrivacyMeta:
    """What an update's privacy mechanism spent: ``epsilon`` is cumulative for the agent;
    ``guarantee`` says what that epsilon is worth ("none" without a formal mechanism, and
    "none (reproducible noise)" when the noise could be replayed from a seed)."""

    mechanism: str = "none"
    epsilon: float | None = None
    delta: float | None = None
    guarantee: str = "none"

    def __post_init__(self) -> None:
        f.text(self.mechanism, field="privacy.mechanism", max_length=MAX_METHOD_LENGTH, empty=False)
        f.text(
            self.guarantee, field="privacy.guarantee", max_length=MAX_GUARANTEE_LENGTH, empty=False
        )
        _freeze(self, "epsilon", f.optional_number(self.epsilon, field="privacy.epsilon", low=0.0))
        _freeze(self, "delta", f.optional_number(self.delta, field="privacy.delta", low=0.0))
        if self.delta is not None and self.delta >= 1.0:
            raise FieldError(f"{self.delta} must be below 1", field="privacy.delta")

    def __eq__(self, other: object) -> bool:
        if type(other) is not PrivacyMeta:
            return NotImplemented
        return (self.mechanism, self.epsilon, self.delta, self.guarantee) == (
            other.mechanism,
            other.epsilon,
            other.delta,
            other.guarantee,
        )

    __hash__ = None  # type: ignore[assignment]

    def to_obj(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "epsilon": self.epsilon, "delta": self.delta,
                "guarantee": self.guarantee}  # fmt: skip

    @classmethod
    def from_obj(cls, obj: object) -> PrivacyMeta:
        m = f.mapping(obj, field="privacy", max_length=4)
        if set(m) != {"mechanism", "epsilon", "delta", "guarantee"}:
            raise FieldError(
                "must have exactly mechanism, epsilon, delta, guarantee", field="privacy"
            )
        return cls(mechanism=m["mechanism"], epsilon=m["epsilon"], delta=m["delta"],
                   guarantee=m["guarantee"])  # fmt: skip


def _check_auth(obj: Any) -> None:
    if obj.auth is not None and not isinstance(obj.auth, Auth):
        raise FieldError("expected Auth", field="auth")


def _take_auth(env: f.Envelope) -> Auth | None:
    obj = env.take_optional("auth")
    return None if obj is None else Auth.from_obj(obj)


def _common(obj: Any) -> None:
    validate_id(obj.fleet, field="fleet")
    f.integer(obj.round, field="round")
    f.text(obj.bundle, field="bundle", max_length=MAX_BUNDLE_ID_LENGTH, empty=False)
    validate_id(obj.method, field="method", max_length=MAX_METHOD_LENGTH)


@dataclass(frozen=True, eq=False)
class PrototypeUpdate(_Message):
    """One client's answer to one round.

    ``prototypes[i]`` is the local prototype of class index ``classes[i]`` computed from
    ``counts[i]`` samples. ``extras`` carries method-specific arrays (FedDBP Fisher scores,
    FedAvg weights) keyed by safe names.
    """

    KIND: ClassVar[str] = "update"

    fleet: str
    round: int
    client: str
    bundle: str
    method: str
    classes: tuple[int, ...]
    counts: tuple[float, ...]
    prototypes: FloatArray
    extras: Mapping[str, FloatArray] = field(default_factory=dict)
    privacy: PrivacyMeta = field(default_factory=PrivacyMeta)
    auth: Auth | None = None

    def __post_init__(self) -> None:
        _check_auth(self)
        _common(self)
        validate_id(self.client, field="client")
        classes = f.sequence(self.classes, field="classes", max_length=MAX_CLASSES)
        classes = tuple(f.integer(c, field="classes", high=MAX_CLASSES - 1) for c in classes)
        _freeze(self, "classes", f.unique(classes, field="classes"))
        counts = f.sequence(self.counts, field="counts", max_length=MAX_CLASSES)
        _freeze(self, "counts", tuple(f.number(c, field="counts", low=0.0) for c in counts))
        if len(self.counts) != len(self.classes):
            raise FieldError(
                f"{len(self.counts)} counts for {len(self.classes)} classes", field="counts"
            )
        protos = check_array(self.prototypes, field="prototypes", ndim=2)
        if protos.shape[0] != len(self.classes):
            raise FieldError(
                f"{protos.shape[0]} prototype rows for {len(self.classes)} classes",
                field="prototypes",
            )
        _freeze(self, "prototypes", protos)
        _freeze(self, "extras", _array_map(self.extras, field="extras", max_length=MAX_EXTRAS))
        if not isinstance(self.privacy, PrivacyMeta):
            raise FieldError("expected PrivacyMeta", field="privacy")

    def _body(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "round": self.round,
            "client": self.client,
            "bundle": self.bundle,
            "method": self.method,
            "classes": list(self.classes),
            "counts": list(self.counts),
            "prototypes": encode_array(self.prototypes),
            "extras": _encode_array_map(self.extras),
            "privacy": self.privacy.to_obj(),
        }

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> PrototypeUpdate:
        return cls(
            fleet=env.take("fleet"),
            round=env.take("round"),
            client=env.take("client"),
            bundle=env.take("bundle"),
            method=env.take("method"),
            classes=env.take("classes"),
            counts=env.take("counts"),
            prototypes=decode_array(env.take("prototypes"), field="prototypes", ndim=2),
            extras=_decode_array_map(env.take("extras"), field="extras", max_length=MAX_EXTRAS),
            privacy=PrivacyMeta.from_obj(env.take("privacy")),
            auth=_take_auth(env),
        )


def _empty_prototypes() -> FloatArray:
    arr = np.zeros((0, 0), dtype=np.float32)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class RoundAnnouncement(_Message):
    """The coordinator's retained message opening round ``round``.

    ``global_prototypes[i]`` is the global prototype of class ``classes[global_classes[i]]``.
    ``local_sets`` maps every client to its padded local prototype set (FedPCL Eq. 7), rows
    aligned with ``global_classes``; ``client_globals`` holds per-client global prototypes
    (FedDBP); ``extras`` carries global weights (FedAvg). ``deadline`` is Unix seconds.
    """

    KIND: ClassVar[str] = "round"

    fleet: str
    round: int
    bundle: str
    method: str
    classes: tuple[str, ...]
    deadline: float
    params: Mapping[str, f.Scalar] = field(default_factory=dict)
    global_classes: tuple[int, ...] = ()
    global_prototypes: FloatArray = field(default_factory=_empty_prototypes)
    local_sets: Mapping[str, FloatArray] = field(default_factory=dict)
    client_globals: Mapping[str, FloatArray] = field(default_factory=dict)
    extras: Mapping[str, FloatArray] = field(default_factory=dict)
    auth: Auth | None = None

    def __post_init__(self) -> None:
        _check_auth(self)
        _common(self)
        names = f.sequence(self.classes, field="classes", max_length=MAX_CLASSES)
        names = tuple(f.text(n, field="classes", empty=False) for n in names)
        _freeze(self, "classes", f.unique(names, field="classes"))
        _freeze(self, "deadline", f.number(self.deadline, field="deadline", low=0.0))
        params = f.mapping(self.params, field="params", max_length=MAX_PARAMS)
        _freeze(
            self,
            "params",
            MappingProxyType(
                {
                    validate_id(k, field="params.key"): f.scalar(v, field=f"params.{k}")
                    for k, v in sorted(params.items(), key=lambda kv: str(kv[0]))
                }
            ),
        )
        gc = f.sequence(self.global_classes, field="global_classes", max_length=MAX_CLASSES)
        gc = tuple(f.integer(c, field="global_classes", high=len(names) - 1) for c in gc)
        _freeze(self, "global_classes", f.unique(gc, field="global_classes"))
        protos = check_array(self.global_prototypes, field="global_prototypes", ndim=2)
        if protos.shape[0] != len(gc):
            raise FieldError(
                f"{protos.shape[0]} rows for {len(gc)} global classes", field="global_prototypes"
            )
        _freeze(self, "global_prototypes", protos)
        for name in ("local_sets", "client_globals"):
            sets = _array_map(getattr(self, name), field=name, max_length=MAX_CLIENTS, ndim=2)
            for client, arr in sets.items():
                if arr.shape != protos.shape:
                    raise FieldError(
                        f"{client} has shape {arr.shape}, global prototypes {protos.shape}",
                        field=f"{name}.{client}",
                    )
            _freeze(self, name, sets)
        _freeze(self, "extras", _array_map(self.extras, field="extras", max_length=MAX_EXTRAS))

    def global_of(self, client: str) -> FloatArray:
        """The global prototypes ``client`` should train against (per-client if given)."""
        return self.client_globals.get(client, self.global_prototypes)

    def _body(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "round": self.round,
            "bundle": self.bundle,
            "method": self.method,
            "classes": list(self.classes),
            "deadline": self.deadline,
            "params": dict(self.params),
            "global_classes": list(self.global_classes),
            "global_prototypes": encode_array(self.global_prototypes),
            "local_sets": _encode_array_map(self.local_sets),
            "client_globals": _encode_array_map(self.client_globals),
            "extras": _encode_array_map(self.extras),
        }

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> RoundAnnouncement:
        return cls(
            fleet=env.take("fleet"),
            round=env.take("round"),
            bundle=env.take("bundle"),
            method=env.take("method"),
            classes=env.take("classes"),
            deadline=env.take("deadline"),
            params=env.take("params"),
            global_classes=env.take("global_classes"),
            global_prototypes=decode_array(
                env.take("global_prototypes"), field="global_prototypes", ndim=2
            ),
            local_sets=_decode_array_map(
                env.take("local_sets"), field="local_sets", max_length=MAX_CLIENTS
            ),
            client_globals=_decode_array_map(
                env.take("client_globals"), field="client_globals", max_length=MAX_CLIENTS
            ),
            extras=_decode_array_map(env.take("extras"), field="extras", max_length=MAX_EXTRAS),
            auth=_take_auth(env),
        )


class AgentState(str, Enum):
    ONLINE = "online"
    OFFLINE = "offline"


#: The ``reason`` of the online status a device publishes once it has handled the final
#: announcement of a fleet with ``max_rounds``: nothing more will come from it.
FINISHED = "finished"


@dataclass(frozen=True, eq=False)
class Status(_Message):
    """A client's retained presence; the offline form is also its MQTT Last Will."""

    KIND: ClassVar[str] = "status"

    fleet: str
    client: str
    state: AgentState
    version: str
    last_round: int | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        validate_id(self.fleet, field="fleet")
        validate_id(self.client, field="client")
        try:
            _freeze(self, "state", AgentState(self.state))
        except ValueError as exc:
            raise FieldError(f"{self.state!r} is not online or offline", field="state") from exc
        f.text(self.version, field="version", max_length=MAX_ID_LENGTH)
        if self.last_round is not None:
            f.integer(self.last_round, field="last_round")
        f.text(self.reason, field="reason")

    def _body(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "client": self.client,
            "state": self.state.value,
            "version": self.version,
            "last_round": self.last_round,
            "reason": self.reason,
        }

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Status:
        state = env.take("state")
        if not isinstance(state, str):
            raise FieldError("expected a string", field="state")
        return cls(
            fleet=env.take("fleet"),
            client=env.take("client"),
            state=state,  # type: ignore[arg-type]
            version=env.take("version"),
            last_round=env.take("last_round"),
            reason=env.take("reason"),
        )


Message = PrototypeUpdate | RoundAnnouncement | Status
