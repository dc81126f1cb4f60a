"""A client's answer to one round, and what its privacy mechanism spent."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol import fields as f
from protocol.arrays import FloatArray, check_array, decode_array, encode_array
from protocol.auth import Auth
from protocol.errors import FieldError
from protocol.ids import validate_id
from protocol.limits import (
    MAX_CLASSES,
    MAX_EXTRAS,
    MAX_GUARANTEE_LENGTH,
    MAX_METHOD_LENGTH,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
)
from protocol.message_base import (
    WireMessage,
    array_map,
    check_auth,
    check_round_fields,
    check_wire_version,
    decode_array_map,
    encode_array_map,
    freeze,
    take_auth,
)


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
        freeze(self, "epsilon", f.optional_number(self.epsilon, field="privacy.epsilon", low=0.0))
        freeze(self, "delta", f.optional_number(self.delta, field="privacy.delta", low=0.0))
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


@dataclass(frozen=True, eq=False)
class PrototypeUpdate(WireMessage):
    """One client's answer to one round.

    ``prototypes[i]`` is the local prototype of class index ``classes[i]`` computed from
    ``counts[i]`` samples. ``extras`` carries method-specific arrays (FedDBP Fisher scores,
    FedAvg weights) keyed by safe names.
    """

    KIND: ClassVar[str] = "update"
    VERSIONS: ClassVar[tuple[int, ...]] = SUPPORTED_VERSIONS

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
    #: The protocol version it travels in: that of the announcement it answers (versions
    #: 2 and 3 write an update alike but for ``v``).
    wire_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_wire_version(self)
        check_auth(self)
        check_round_fields(self)
        validate_id(self.client, field="client")
        classes = f.sequence(self.classes, field="classes", max_length=MAX_CLASSES)
        classes = tuple(f.integer(c, field="classes", high=MAX_CLASSES - 1) for c in classes)
        freeze(self, "classes", f.unique(classes, field="classes"))
        counts = f.sequence(self.counts, field="counts", max_length=MAX_CLASSES)
        freeze(self, "counts", tuple(f.number(c, field="counts", low=0.0) for c in counts))
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
        freeze(self, "prototypes", protos)
        freeze(self, "extras", array_map(self.extras, field="extras", max_length=MAX_EXTRAS))
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
            "extras": encode_array_map(self.extras),
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
            extras=decode_array_map(env.take("extras"), field="extras", max_length=MAX_EXTRAS),
            privacy=PrivacyMeta.from_obj(env.take("privacy")),
            auth=take_auth(env),
            wire_version=env.version,
        )
