"""The consistency stage (Bonawitz et al., CCS 2017, the active-adversary protocol): after
the masked inputs, each survivor signs a digest of the survivor list it was given and of
the roster it was given, and no device releases a share before at least ``T`` survivors (the
fleet's quorum, ``t`` unless the table sets one), itself among them, have signed the very
list and roster it holds.

A coordinator that tells devices different lists (that a device survived, that it
dropped) gets each list signed only by those it told; with ``2T > n + c`` no two lists
both gather ``T`` signatures, so every device that releases a share holds the same list
as ``T`` others. On a sparse graph a neighbourhood's ``t`` (``<= k + 1``, far below
``n / 2``) would let two lists each gather ``t``: hence the quorum (docs/privacy.md,
"Equivocation across devices").

In a signed fleet each signature is checked under the fleet CA's certificate for its
signer (:mod:`~secagg.enrolled`): a neighbour's from its advertisement, any other's as the
coordinator relays it with the signatures (which it cannot forge: the CA issued it, to
that id). What a device receives grows with the fleet by one signed digest (and, on a
sparse graph, one certificate) per survivor. In an insecure fleet the digests are
compared unsigned: the check then stops a coordinator that shows a device a list fewer
than ``T`` survivors hold, not one that forges their answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol import fields as f
from protocol.errors import FieldError, ProtocolError
from protocol.message_base import freeze
from secagg.enrolled import Enrolment
from secagg.messages import DIGEST_BYTES, MAX_ADVERT_BYTES, MAX_CERTIFICATE_BYTES, SecAggMessage
from secagg.rows import blob, id_map, table


@dataclass(frozen=True, eq=False, kw_only=True)
class Consistency(SecAggMessage):
    """Device to coordinator: ``listed``, the digest of the survivor list it was sent
    (:func:`list_digest`), and ``roster``, the digest of the roster it was sent
    (:func:`roster_digest`), signed (``auth``). Digests, not the lists: each device gets
    every survivor's, so a list in each would grow with the square of the fleet. No
    certificate travels here: a device knows its neighbours' from their advertisements,
    and the coordinator relays the others' with the signatures."""

    KIND: ClassVar[str] = "secagg_consistency"

    listed: bytes
    roster: bytes

    def __post_init__(self) -> None:
        super().__post_init__()
        blob(self.listed, field="listed", size=DIGEST_BYTES)
        blob(self.roster, field="roster", size=DIGEST_BYTES)

    def _body(self) -> dict[str, Any]:
        return {**self._head(), "listed": self.listed, "roster": self.roster}

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Consistency:
        return cls(**cls._take_head(env), listed=env.take("listed"), roster=env.take("roster"))


def roster_digest(clients: Sequence[str]) -> bytes:
    """SHA-256 of a roster's sorted client list, one id a line (ids hold no newline)."""
    return hashlib.sha256("\n".join(["protofleet/secagg/roster/v1", *clients]).encode()).digest()


def list_digest(survivors: Sequence[str]) -> bytes:
    """SHA-256 of a survivor list (sorted, as sent), one id a line."""
    return hashlib.sha256(
        "\n".join(["protofleet/secagg/survivors/v1", *survivors]).encode()
    ).digest()


@dataclass(frozen=True, eq=False, kw_only=True)
class Signatures(SecAggMessage):
    """Coordinator to ``client``: the survivors' :class:`Consistency` messages as they
    signed them (id -> wire payload); ``certificates``, in a signed fleet, the fleet CA's
    certificate (DER) of each signer that is not ``client``'s neighbour, as that signer
    advertised it (``client`` holds its neighbours' already)."""

    KIND: ClassVar[str] = "secagg_signatures"

    signed: Mapping[str, bytes] = field(default_factory=dict)
    certificates: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, size in (("signed", MAX_ADVERT_BYTES), ("certificates", MAX_CERTIFICATE_BYTES)):
            rows = id_map(getattr(self, name), field=name)
            for v, payload in rows.items():
                if len(blob(payload, field=f"{name}.{v}")) > size:
                    raise FieldError(f"more than {size} bytes", field=f"{name}.{v}")
            freeze(self, name, rows)

    def _body(self) -> dict[str, Any]:
        body = {**self._head(), "signed": [[k, v] for k, v in self.signed.items()]}
        if self.certificates:
            body["certificates"] = [[k, v] for k, v in self.certificates.items()]
        return body

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Signatures:
        rows = table(env.take("signed"), field="signed", width=2)
        certificates = env.take_optional("certificates")
        held = [] if certificates is None else table(certificates, field="certificates", width=2)
        return cls(**cls._take_head(env), signed=dict(rows), certificates=dict(held))


def unsigned_problem(
    signatures: Signatures, *, survivors: tuple[str, ...], roster: bytes, fleet: str,
    round: int, threshold: int, enrolment: Enrolment | None, least: str = "",
    certificates: Mapping[str, bytes] | None = None,
) -> tuple[str, str | None] | None:  # fmt: skip
    """Why ``signatures`` do not show ``threshold`` survivors signing ``survivors``, with
    the device to blame if one; None if they do. Every entry must be a survivor's
    :class:`Consistency` of this round naming that very list and ``roster``, and, with
    ``enrolment``, signed under the fleet CA's certificate for its sender: from
    ``certificates`` (the device's own and its neighbours'), else as relayed. ``least``:
    how the refusal names ``threshold`` (``T = 900``; ``t = ...`` by default)."""
    listed = list_digest(survivors)
    known = dict(certificates or {})
    for v, payload in signatures.signed.items():
        try:
            message = Consistency.from_wire(payload, max_bytes=MAX_ADVERT_BYTES)
        except ProtocolError as exc:
            return f"a survivor's signed list does not decode ({exc.reason})", v
        if (message.fleet, message.round, message.client) != (fleet, round, v):
            return "a survivor's signed list is another device's or another round's", v
        if v not in survivors:
            return "a device that is not a survivor signed a list", v
        if message.listed != listed:
            return "a survivor signed another survivor list than this device's", v
        if message.roster != roster:
            return "a survivor was sent another roster than this device", v
        if enrolment is not None:
            certificate = known.get(v, signatures.certificates.get(v, b""))
            why = enrolment.vouches(message, certificate=certificate)
            if why is not None:
                return f"a survivor's signed list {why}", v
    if len(signatures.signed) < threshold:
        count = len(signatures.signed)
        least = least or f"t = {threshold}"
        return f"{count} survivors signed its survivor list, fewer than {least}", None
    return None
