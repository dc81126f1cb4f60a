"""The consistency stage (Bonawitz et al., CCS 2017, the active-adversary protocol): after
the masked inputs, each survivor signs the survivor list it was given and a digest of the
roster it was given, and no device releases a share before at least ``T`` survivors (the
fleet's quorum, ``t`` unless the table sets one), itself among them, have signed the very
list and roster it holds.

A coordinator that tells devices different lists (that a device survived, that it
dropped) gets each list signed only by those it told; with ``2T > n + c`` no two lists
both gather ``T`` signatures, so every device that releases a share holds the same list
as ``T`` others. On a sparse graph a neighbourhood's ``t`` (``<= k + 1``, far below
``n / 2``) would let two lists each gather ``t``: hence the quorum (docs/privacy.md,
"Equivocation across devices").

In a signed fleet each :class:`Consistency` carries its sender's certificate from the
fleet CA, as an advertisement does (:mod:`~secagg.enrolled`), because a device checks the
signatures of survivors that are not its neighbours too. In an insecure fleet the lists
are compared unsigned: the check then stops a coordinator that shows a device a list
fewer than ``t`` survivors hold, not one that forges their answers.
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
from secagg.rows import blob, id_map, ids, table


@dataclass(frozen=True, eq=False, kw_only=True)
class Consistency(SecAggMessage):
    """Device to coordinator: ``survivors``, the list it was sent, and ``roster``, the
    digest of the roster it was sent (:func:`roster_digest`), signed (``auth``);
    ``certificate``, its certificate from the fleet CA in a signed fleet (empty, and
    absent from the wire, otherwise)."""

    KIND: ClassVar[str] = "secagg_consistency"

    survivors: tuple[str, ...]
    roster: bytes
    certificate: bytes = b""

    def __post_init__(self) -> None:
        super().__post_init__()
        freeze(self, "survivors", ids(self.survivors, field="survivors"))
        blob(self.roster, field="roster", size=DIGEST_BYTES)
        blob(self.certificate, field="certificate")
        if len(self.certificate) > MAX_CERTIFICATE_BYTES:
            raise FieldError(f"more than {MAX_CERTIFICATE_BYTES} bytes", field="certificate")

    def _body(self) -> dict[str, Any]:
        body = {**self._head(), "survivors": list(self.survivors), "roster": self.roster}
        return {**body, "certificate": self.certificate} if self.certificate else body

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Consistency:
        head = cls._take_head(env)
        certificate = env.take_optional("certificate")
        return cls(**head, survivors=env.take("survivors"), roster=env.take("roster"),
                   certificate=b"" if certificate is None else certificate)  # fmt: skip


def roster_digest(clients: Sequence[str]) -> bytes:
    """SHA-256 of a roster's sorted client list, one id a line (ids hold no newline)."""
    return hashlib.sha256("\n".join(["protofleet/secagg/roster/v1", *clients]).encode()).digest()


@dataclass(frozen=True, eq=False, kw_only=True)
class Signatures(SecAggMessage):
    """Coordinator to ``client``: the survivors' :class:`Consistency` messages as they
    signed them (id -> wire payload)."""

    KIND: ClassVar[str] = "secagg_signatures"

    signed: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        signed = id_map(self.signed, field="signed")
        for name, payload in signed.items():
            if len(blob(payload, field=f"signed.{name}")) > MAX_ADVERT_BYTES:
                raise FieldError(f"more than {MAX_ADVERT_BYTES} bytes", field=f"signed.{name}")
        freeze(self, "signed", signed)

    def _body(self) -> dict[str, Any]:
        return {**self._head(), "signed": [[k, v] for k, v in self.signed.items()]}

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Signatures:
        rows = table(env.take("signed"), field="signed", width=2)
        return cls(**cls._take_head(env), signed=dict(rows))


def unsigned_problem(
    signatures: Signatures, *, survivors: tuple[str, ...], roster: bytes, fleet: str,
    round: int, threshold: int, enrolment: Enrolment | None, least: str = "",
) -> tuple[str, str | None] | None:  # fmt: skip
    """Why ``signatures`` do not show ``threshold`` survivors signing ``survivors``, with
    the device to blame if one; None if they do. Every entry must be a survivor's
    :class:`Consistency` of this round naming that very list and ``roster``, and, with ``enrolment``,
    signed under the fleet CA's certificate for its sender. ``least``: how the refusal
    names ``threshold`` (``T = 900``; ``t = ...`` by default)."""
    for v, payload in signatures.signed.items():
        try:
            message = Consistency.from_wire(payload, max_bytes=MAX_ADVERT_BYTES)
        except ProtocolError as exc:
            return f"a survivor's signed list does not decode ({exc.reason})", v
        if (message.fleet, message.round, message.client) != (fleet, round, v):
            return "a survivor's signed list is another device's or another round's", v
        if v not in survivors:
            return "a device that is not a survivor signed a list", v
        if message.survivors != survivors:
            return "a survivor signed another survivor list than this device's", v
        if message.roster != roster:
            return "a survivor was sent another roster than this device", v
        why = None if enrolment is None else enrolment.vouches(message)
        if why is not None:
            return f"a survivor's signed list {why}", v
    if len(signatures.signed) < threshold:
        count = len(signatures.signed)
        least = least or f"t = {threshold}"
        return f"{count} survivors signed its survivor list, fewer than {least}", None
    return None
