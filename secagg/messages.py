"""The secure-aggregation round's messages, one frozen dataclass per stage and direction.

Devices send :class:`Advertise`, :class:`ShareKeys`, :class:`MaskedInput` and
:class:`Unmask`; the coordinator answers each device with :class:`Roster`,
:class:`RelayedShares`, :class:`~secagg.consistency.Survivors` and :class:`Close`, or an :class:`Abort`;
the consistency stage's two are in :mod:`~secagg.consistency`. Every message names the fleet, the round and one device (the sender of a device's
message, the recipient of the coordinator's), and carries an optional ``auth`` trailer so
that :func:`protocol.auth.sign` can sign it unchanged.

Each validates itself on construction, so :meth:`from_wire` raises a
:class:`~protocol.errors.ProtocolError` for any malformed payload. Collections keyed by a
device travel as lists of rows, ``[id, ...]``, not msgpack maps: a map that names a device
twice decodes silently to its last entry, while a list keeps the duplicate for the check
to refuse. Whether a well-formed message makes sense for the round (the right keys, the
right neighbours) is for :mod:`~secagg.device` and :mod:`~secagg.server`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, TypeVar

import numpy as np

from protocol import fields as f
from protocol.auth import Auth
from protocol.errors import FieldError
from protocol.ids import validate_id
from protocol.message_base import WireMessage, check_auth, freeze, take_auth
from secagg.masks import RING_DTYPES
from secagg.rows import blob, id_map, packed_ids, roster_ids, table
from secagg.shamir import P521

#: An X25519 public key.
KEY_BYTES = 32
#: A SHA-256 digest: of the ``[secure_aggregation]`` table (secagg/fleet.py), or the
#: commitment to a self-mask seed (secagg/masks.py).
DIGEST_BYTES = 32
#: One Shamir share's value in GF(2^521 - 1), big-endian.
SHARE_BYTES = (P521.bit_length() + 7) // 8
#: The most a device's certificate (DER) may take: make-certs.sh's are about 450 bytes.
MAX_CERTIFICATE_BYTES = 4096
#: The most a neighbour's signed advertisement, relayed in a roster, may take.
MAX_ADVERT_BYTES = MAX_CERTIFICATE_BYTES + 1024
#: ChaCha20-Poly1305 over a share of ``b_u`` and a share of ``s_u``: two values and a tag.
CIPHERTEXT_BYTES = 2 * SHARE_BYTES + 16

C = TypeVar("C", bound="_Ciphertexts")


class Stage(str, Enum):
    """The round's stages, in order; an :class:`Abort` names the one that failed."""

    ADVERTISE = "advertise"
    SHARE = "share"
    MASKED_INPUT = "masked_input"
    CONSISTENCY = "consistency"
    UNMASK = "unmask"


@dataclass(frozen=True, eq=False, kw_only=True)
class SecAggMessage(WireMessage):
    """What every message of the round carries: fleet, round, the device it is from or
    for, and the signature trailer (absent from the wire when unsigned)."""

    fleet: str
    round: int
    client: str
    auth: Auth | None = None

    def __post_init__(self) -> None:
        check_auth(self)
        validate_id(self.fleet, field="fleet")
        f.integer(self.round, field="round")
        validate_id(self.client, field="client")

    def _head(self) -> dict[str, Any]:
        return {"fleet": self.fleet, "round": self.round, "client": self.client}

    @staticmethod
    def _take_head(env: f.Envelope) -> dict[str, Any]:
        return {
            "fleet": env.take("fleet"),
            "round": env.take("round"),
            "client": env.take("client"),
            "auth": take_auth(env),
        }


@dataclass(frozen=True, eq=True, kw_only=True)
class PublicKeys:
    """A device's two X25519 public keys: ``c`` to encrypt shares to it, ``s`` to agree
    pairwise masks with it."""

    c: bytes
    s: bytes

    def __post_init__(self) -> None:
        blob(self.c, field="c", size=KEY_BYTES)
        blob(self.s, field="s", size=KEY_BYTES)
        if self.c == self.s:
            # One key for both jobs would let a rebuilt mask key decrypt the device's shares.
            raise FieldError("the encryption and masking keys must differ", field="s")


@dataclass(frozen=True, eq=False, kw_only=True)
class Advertise(SecAggMessage):
    """Stage 1, device to coordinator: the sender's fresh public keys for this round;
    ``table``, the digest of the ``[secure_aggregation]`` table the sender's settings were
    made from; and ``commitment``, its commitment to its self-mask seed
    (:func:`secagg.masks.seed_commitment`). Either may be empty (none): an advertisement
    from before the field decodes so, and the coordinator excludes it. ``certificate``:
    in a signed fleet, the sender's certificate from the fleet CA (DER), which binds its
    id to the key that signs this advertisement, so that its neighbours can check the
    keys are its own (:mod:`secagg.enrolled`); empty (absent from the wire) otherwise.
    ``summed``: the round of the sender's latest input the fleet's running sum holds, as
    the sender knows it (-1, absent from the wire: none), and ``receipt`` the coordinator's
    signed :class:`Close` or :class:`Abort` that said so (coordinator/rounds/secure_record.py)."""

    KIND: ClassVar[str] = "secagg_advertise"

    keys: PublicKeys
    table: bytes = b""
    commitment: bytes = b""
    certificate: bytes = b""
    summed: int = -1
    receipt: bytes = b""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.keys, PublicKeys):
            raise FieldError("expected PublicKeys", field="keys")
        for name in ("table", "commitment"):
            value = getattr(self, name)
            blob(value, field=name, size=DIGEST_BYTES if value else None)
        for name in ("certificate", "receipt"):
            if len(blob(getattr(self, name), field=name)) > MAX_CERTIFICATE_BYTES:
                raise FieldError(f"more than {MAX_CERTIFICATE_BYTES} bytes", field=name)
        f.integer(self.summed, field="summed", low=-1)

    def _body(self) -> dict[str, Any]:
        body = {**self._head(), "c": self.keys.c, "s": self.keys.s, "table": self.table,
                "commitment": self.commitment}  # fmt: skip
        optional = {"certificate": self.certificate, "receipt": self.receipt}
        body |= {k: v for k, v in optional.items() if v}
        return body | ({"summed": self.summed} if self.summed >= 0 else {})

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Advertise:
        keys = PublicKeys(c=env.take("c"), s=env.take("s"))
        fields: dict[str, Any] = {**cls._take_head(env), "keys": keys}
        for k, absent in (("table", b""), ("commitment", b""), ("certificate", b""),
                          ("receipt", b""), ("summed", -1)):  # fmt: skip
            value = env.take_optional(k)
            fields[k] = absent if value is None else value
        return cls(**fields)


@dataclass(frozen=True, eq=False, kw_only=True)
class Roster(SecAggMessage):
    """Stage 1's answer, coordinator to ``client``: every device that advertised
    (``clients``, sorted: the graph's public seed) and the keys of ``client`` and its
    neighbours (``keys``). ``adverts``: in a signed fleet, each neighbour's advertisement
    as it signed it (its wire payload, id -> bytes), for ``client`` to check the keys
    against the neighbour's certificate and signature; empty otherwise."""

    KIND: ClassVar[str] = "secagg_roster"

    clients: tuple[str, ...]
    keys: Mapping[str, PublicKeys]
    adverts: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        clients, named = roster_ids(self.clients)
        if self.client not in named:
            raise FieldError(f"does not name the recipient {self.client}", field="clients")
        freeze(self, "clients", clients)
        keys = id_map(self.keys, field="keys")
        for name, pair in keys.items():
            if not isinstance(pair, PublicKeys):
                raise FieldError("expected PublicKeys", field=f"keys.{name}")
            if name not in named:  # the set: a tuple's scan made n rosters quadratic
                raise FieldError(f"{name} is not in the roster", field="keys")
        if self.client not in keys:
            raise FieldError(f"has no keys for the recipient {self.client}", field="keys")
        freeze(self, "keys", keys)
        adverts = id_map(self.adverts, field="adverts")
        for name, payload in adverts.items():
            if name not in keys:
                raise FieldError(f"{name} has no keys in the roster", field="adverts")
            if len(blob(payload, field=f"adverts.{name}")) > MAX_ADVERT_BYTES:
                raise FieldError(f"more than {MAX_ADVERT_BYTES} bytes", field=f"adverts.{name}")
        freeze(self, "adverts", adverts)

    def _body(self) -> dict[str, Any]:
        rows = [[name, pair.c, pair.s] for name, pair in self.keys.items()]
        body = {**self._head(), "clients": packed_ids(self.clients), "keys": rows}
        signed = [[name, payload] for name, payload in self.adverts.items()]
        return {**body, "adverts": signed} if signed else body

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Roster:
        head = cls._take_head(env)
        rows = table(env.take("keys"), field="keys", width=3)
        keys = {row[0]: PublicKeys(c=row[1], s=row[2]) for row in rows}
        signed = env.take_optional("adverts")
        adverts = {} if signed is None else dict(table(signed, field="adverts", width=2))
        return cls(**head, clients=env.take("clients"), keys=keys, adverts=adverts)


@dataclass(frozen=True, eq=False, kw_only=True)
class _Ciphertexts(SecAggMessage):
    """Encrypted shares keyed by the other device of each pair (never ``client``)."""

    ciphertexts: Mapping[str, bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        cts = id_map(self.ciphertexts, field="ciphertexts")
        for name, ct in cts.items():
            blob(ct, field=f"ciphertexts.{name}", size=CIPHERTEXT_BYTES)
        if self.client in cts:
            raise FieldError(f"{self.client} cannot share with itself", field="ciphertexts")
        freeze(self, "ciphertexts", cts)

    def _body(self) -> dict[str, Any]:
        return {**self._head(), "ciphertexts": [[k, v] for k, v in self.ciphertexts.items()]}

    @classmethod
    def _from_envelope(cls: type[C], env: f.Envelope) -> C:
        head = SecAggMessage._take_head(env)
        rows = table(env.take("ciphertexts"), field="ciphertexts", width=2)
        return cls(**head, ciphertexts={row[0]: row[1] for row in rows})


@dataclass(frozen=True, eq=False, kw_only=True)
class ShareKeys(_Ciphertexts):
    """Stage 2, device to coordinator: for each neighbour (recipient id -> ciphertext),
    the sender's Shamir shares of its self-mask seed ``b_u`` and masking key ``s_u``."""

    KIND: ClassVar[str] = "secagg_share"


@dataclass(frozen=True, eq=False, kw_only=True)
class RelayedShares(_Ciphertexts):
    """Stage 2's answer, coordinator to ``client``: the ciphertexts its neighbours that
    shared keys addressed to it (sender id -> ciphertext)."""

    KIND: ClassVar[str] = "secagg_relay"


@dataclass(frozen=True, eq=False, kw_only=True)
class MaskedInput(SecAggMessage):
    """Stage 3, device to coordinator: ``y_u`` in ``Z_{2^bits}`` as little-endian words."""

    KIND: ClassVar[str] = "secagg_masked"

    bits: int
    masked: bytes

    def __post_init__(self) -> None:
        super().__post_init__()
        if type(self.bits) is not int or self.bits not in RING_DTYPES:
            raise FieldError(f"{self.bits!r} is not one of {sorted(RING_DTYPES)}", field="bits")
        blob(self.masked, field="masked")
        if not self.masked or len(self.masked) % (self.bits // 8):
            size = len(self.masked)
            raise FieldError(f"{size} bytes are not whole {self.bits}-bit words", field="masked")

    def vector(self) -> np.ndarray:
        """The masked vector as ring elements (a read-only view of the bytes)."""
        return np.frombuffer(self.masked, dtype=RING_DTYPES[self.bits])

    def _body(self) -> dict[str, Any]:
        return {**self._head(), "bits": self.bits, "masked": self.masked}

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> MaskedInput:
        head = cls._take_head(env)
        return cls(**head, bits=env.take("bits"), masked=env.take("masked"))


@dataclass(frozen=True, eq=False, kw_only=True)
class Unmask(SecAggMessage):
    """Stage 5, device to coordinator: Shamir share values (big-endian, ``SHARE_BYTES``)
    of ``b_v`` for each surviving ``v`` (``seed_shares``) and of ``s_v`` for each dropped
    one (``key_shares``). Both for one device would unmask its input: refused."""

    KIND: ClassVar[str] = "secagg_unmask"

    seed_shares: Mapping[str, bytes]
    key_shares: Mapping[str, bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("seed_shares", "key_shares"):
            shares = id_map(getattr(self, name), field=name)
            for holder, value in shares.items():
                blob(value, field=f"{name}.{holder}", size=SHARE_BYTES)
            freeze(self, name, shares)
        both = sorted(set(self.seed_shares) & set(self.key_shares))
        if both:
            raise FieldError(f"gives both shares of {both[0]}", field="key_shares")

    def _body(self) -> dict[str, Any]:
        return {
            **self._head(),
            "seed_shares": [[k, v] for k, v in self.seed_shares.items()],
            "key_shares": [[k, v] for k, v in self.key_shares.items()],
        }

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Unmask:
        head = cls._take_head(env)
        seeds = table(env.take("seed_shares"), field="seed_shares", width=2)
        keys = table(env.take("key_shares"), field="key_shares", width=2)
        return cls(**head, seed_shares=dict(seeds), key_shares=dict(keys))


@dataclass(frozen=True, eq=False, kw_only=True)
class Abort(SecAggMessage):
    """Coordinator to ``client``: the round stopped at ``stage``, and why. ``holds``: for a
    device refused because it is wrong about what the fleet's sum holds of it, the round
    of its latest input the sum holds (-1: none); None (absent from the wire) otherwise."""

    KIND: ClassVar[str] = "secagg_abort"

    stage: Stage
    reason: str
    holds: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            freeze(self, "stage", Stage(self.stage))
        except ValueError as exc:
            raise FieldError(f"{self.stage!r} is not a stage", field="stage") from exc
        f.text(self.reason, field="reason", empty=False)
        if self.holds is not None:
            f.integer(self.holds, field="holds", low=-1)

    def _body(self) -> dict[str, Any]:
        body = {**self._head(), "stage": self.stage.value, "reason": self.reason}
        return body if self.holds is None else {**body, "holds": self.holds}

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Abort:
        head = cls._take_head(env)
        return cls(**head, stage=env.take("stage"), reason=env.take("reason"),
                   holds=env.take_optional("holds"))  # fmt: skip


@dataclass(frozen=True, eq=False, kw_only=True)
class Close(SecAggMessage):
    """After the round's sum is unmasked, coordinator to ``client``: whether its input is
    in the sum (``summed``), as it is once its masked input arrived, unmask answer or
    not. A device marks its data summed from this, never from its own view of the stages."""

    KIND: ClassVar[str] = "secagg_close"

    summed: bool

    def __post_init__(self) -> None:
        super().__post_init__()
        if type(self.summed) is not bool:
            raise FieldError(f"expected a bool, got {type(self.summed).__name__}", field="summed")

    def _body(self) -> dict[str, Any]:
        return {**self._head(), "summed": self.summed}

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Close:
        return cls(**cls._take_head(env), summed=env.take("summed"))
