"""The coordinator's retained announcement that opens a round."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from protocol import fields as f
from protocol.arrays import FloatArray, check_array, decode_array, encode_array
from protocol.auth import Auth
from protocol.errors import FieldError
from protocol.ids import validate_id
from protocol.limits import (
    MAX_CLASSES,
    MAX_CLIENTS,
    MAX_EXTRAS,
    MAX_PARAMS,
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
    legacy_run,
    take_auth,
)

#: ``params`` keys a coordinator sets beside ``final``: the oldest protocol version it
#: still reads, and when it stops (Unix seconds; absent while no date is set).
PARAM_OLDEST_VERSION = "protocol_oldest"
PARAM_OLDEST_UNTIL = "protocol_oldest_until"


def _empty_prototypes() -> FloatArray:
    arr = np.zeros((0, 0), dtype=np.float32)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class RoundAnnouncement(WireMessage):
    """The coordinator's retained message opening round ``round``.

    ``global_prototypes[i]`` is the global prototype of class ``classes[global_classes[i]]``.
    ``run`` names the coordinator's run and ``run_started`` when it began (Unix seconds): a
    device follows one run and adopts another only when it started later (a database lost
    or replaced), answering its rounds from where it stands; ``dim`` is the prototype
    dimension the fleet's updates must have, said before any global prototype exists.
    ``local_sets`` maps clients to their padded local prototype sets (FedPCL Eq. 7), rows
    aligned with ``global_classes``: every client's, or a uniform sample of them that keeps
    the announcement within the coordinator's downlink budget; ``client_globals`` holds per-client global prototypes
    (FedDBP); ``extras`` carries global weights (FedAvg). ``deadline`` is Unix seconds.
    """

    KIND: ClassVar[str] = "round"
    VERSIONS: ClassVar[tuple[int, ...]] = SUPPORTED_VERSIONS

    fleet: str
    round: int
    run: str
    run_started: float
    bundle: str
    method: str
    classes: tuple[str, ...]
    dim: int
    deadline: float
    params: Mapping[str, f.Scalar] = field(default_factory=dict)
    global_classes: tuple[int, ...] = ()
    global_prototypes: FloatArray = field(default_factory=_empty_prototypes)
    local_sets: Mapping[str, FloatArray] = field(default_factory=dict)
    client_globals: Mapping[str, FloatArray] = field(default_factory=dict)
    extras: Mapping[str, FloatArray] = field(default_factory=dict)
    auth: Auth | None = None
    #: The protocol version it travels in. Version 2 has no ``run``, ``run_started`` or
    #: ``dim``: read back, ``run`` is the run its signature names (``""`` unsigned),
    #: ``run_started`` 0 and ``dim`` the width of its prototype rows (0 without rows).
    wire_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_wire_version(self)
        check_auth(self)
        check_round_fields(self)
        if self.run or self.wire_version >= 3:
            validate_id(self.run, field="run")
        freeze(self, "run_started", f.number(self.run_started, field="run_started", low=0.0))
        freeze(self, "dim", f.integer(self.dim, field="dim"))
        names = f.sequence(self.classes, field="classes", max_length=MAX_CLASSES)
        names = tuple(f.text(n, field="classes", empty=False) for n in names)
        freeze(self, "classes", f.unique(names, field="classes"))
        freeze(self, "deadline", f.number(self.deadline, field="deadline", low=0.0))
        params = f.mapping(self.params, field="params", max_length=MAX_PARAMS)
        freeze(
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
        freeze(self, "global_classes", f.unique(gc, field="global_classes"))
        protos = check_array(self.global_prototypes, field="global_prototypes", ndim=2)
        if protos.shape[0] != len(gc):
            raise FieldError(
                f"{protos.shape[0]} rows for {len(gc)} global classes", field="global_prototypes"
            )
        if protos.shape[0] and protos.shape[1] != self.dim:
            raise FieldError(
                f"rows of dimension {protos.shape[1]}, the announcement says dim {self.dim}",
                field="global_prototypes",
            )
        freeze(self, "global_prototypes", protos)
        for name in ("local_sets", "client_globals"):
            sets = array_map(getattr(self, name), field=name, max_length=MAX_CLIENTS, ndim=2)
            for client, arr in sets.items():
                if arr.shape != protos.shape:
                    raise FieldError(
                        f"{client} has shape {arr.shape}, global prototypes {protos.shape}",
                        field=f"{name}.{client}",
                    )
            freeze(self, name, sets)
        freeze(self, "extras", array_map(self.extras, field="extras", max_length=MAX_EXTRAS))

    def global_of(self, client: str) -> FloatArray:
        """The global prototypes ``client`` should train against (per-client if given)."""
        return self.client_globals.get(client, self.global_prototypes)

    def _body(self) -> dict[str, Any]:
        body = {
            "fleet": self.fleet,
            "round": self.round,
            "run": self.run,
            "run_started": self.run_started,
            "bundle": self.bundle,
            "method": self.method,
            "classes": list(self.classes),
            "dim": self.dim,
            "deadline": self.deadline,
            "params": dict(self.params),
            "global_classes": list(self.global_classes),
            "global_prototypes": encode_array(self.global_prototypes),
            "local_sets": encode_array_map(self.local_sets),
            "client_globals": encode_array_map(self.client_globals),
            "extras": encode_array_map(self.extras),
        }
        if self.wire_version < 3:
            for name in ("run", "run_started", "dim"):
                del body[name]
        return body

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> RoundAnnouncement:
        auth = take_auth(env)
        current = env.version >= 3
        protos = decode_array(env.take("global_prototypes"), field="global_prototypes", ndim=2)
        return cls(
            fleet=env.take("fleet"),
            round=env.take("round"),
            run=env.take("run") if current else legacy_run(auth),
            run_started=env.take("run_started") if current else 0.0,
            bundle=env.take("bundle"),
            method=env.take("method"),
            classes=env.take("classes"),
            dim=env.take("dim") if current else int(protos.shape[1]),
            deadline=env.take("deadline"),
            params=env.take("params"),
            global_classes=env.take("global_classes"),
            global_prototypes=protos,
            local_sets=decode_array_map(
                env.take("local_sets"), field="local_sets", max_length=MAX_CLIENTS
            ),
            client_globals=decode_array_map(
                env.take("client_globals"), field="client_globals", max_length=MAX_CLIENTS
            ),
            extras=decode_array_map(env.take("extras"), field="extras", max_length=MAX_EXTRAS),
            auth=auth,
            wire_version=env.version,
        )
