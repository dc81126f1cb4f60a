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
that id). Sent whole, what a device receives grows with the fleet by one signed digest
(and, on a sparse graph, one certificate) per survivor; where that is the larger, the
coordinator sends the compact form instead (secagg/evidence.py): the signers' marks, a
Merkle root over their signed digests, and the entries the recipient's draws open. In an
insecure fleet the digests are compared unsigned: the check then stops a coordinator
that shows a device a list fewer than ``T`` survivors hold, not one that forges their
answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol import fields as f
from protocol.errors import FieldError, ProtocolError
from protocol.message_base import freeze
from secagg.enrolled import Enrolment
from secagg.evidence import (
    HASH_BYTES,
    commitment,
    compact_pays,
    leaf,
    levels,
    marked,
    marks_of,
    multipath,
    multiroot,
    openings,
    positions,
)
from secagg.messages import DIGEST_BYTES, MAX_ADVERT_BYTES, MAX_CERTIFICATE_BYTES, SecAggMessage
from secagg.rows import blob, id_map, ids, table
from secagg.settings import SecAggSettings


@dataclass(frozen=True, eq=False, kw_only=True)
class Survivors(SecAggMessage):
    """Stage 3's answer, coordinator to ``client``: the devices whose masked inputs are in
    the sum. Each neighbour that shared keys but is not listed has dropped. Either
    ``survivors``, the list, or ``marks``, a bitmap over the recipient's roster (its sorted
    clients, bit ``i % 8`` of byte ``i // 8``): a byte for eight devices where the ids take
    ten or more bytes each (100 kB a device at 10,000)."""

    KIND: ClassVar[str] = "secagg_survivors"

    survivors: tuple[str, ...] = ()
    marks: bytes = b""

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.survivors) == bool(blob(self.marks, field="marks")):
            raise FieldError("give the survivors or their marks, one of the two", field="survivors")
        if self.survivors:
            freeze(self, "survivors", ids(self.survivors, field="survivors"))

    def listed(self, roster: Sequence[str]) -> tuple[str, ...]:
        """The survivor list: as sent, or the devices of ``roster`` its marks name; raises
        FieldError for marks that do not fit the roster or name nobody."""
        if self.survivors:
            return self.survivors
        names = tuple(marked(roster, self.marks))
        if not names:
            raise FieldError("mark no device", field="marks")
        return names

    def _body(self) -> dict[str, Any]:
        if self.marks:
            return {**self._head(), "marks": self.marks}
        return {**self._head(), "survivors": list(self.survivors)}

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Survivors:
        listed, marks = env.take_optional("survivors"), env.take_optional("marks")
        return cls(**cls._take_head(env), survivors=listed or (), marks=marks or b"")


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
    advertised it (``client`` holds its neighbours' already).

    Compact (``marks`` not empty, secagg/evidence.py): ``marks``, the bitmap over the
    survivor list of those who signed it; ``root``, the Merkle root over their signed
    messages in list order; ``signed``, only the entries ``client``'s draws open, and
    ``proof``, the nodes that lead them to the root (secagg.evidence.multipath)."""

    KIND: ClassVar[str] = "secagg_signatures"

    signed: Mapping[str, bytes] = field(default_factory=dict)
    certificates: Mapping[str, bytes] = field(default_factory=dict)
    marks: bytes = b""
    root: bytes = b""
    proof: bytes = b""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, size in (("signed", MAX_ADVERT_BYTES), ("certificates", MAX_CERTIFICATE_BYTES)):
            rows = id_map(getattr(self, name), field=name)
            for v, payload in rows.items():
                if len(blob(payload, field=f"{name}.{v}")) > size:
                    raise FieldError(f"more than {size} bytes", field=f"{name}.{v}")
            freeze(self, name, rows)
        blob(self.marks, field="marks")
        blob(self.root, field="root", size=HASH_BYTES if self.marks else 0)
        if len(blob(self.proof, field="proof")) % HASH_BYTES or (self.proof and not self.marks):
            raise FieldError(f"expected whole {HASH_BYTES}-byte nodes, with marks", field="proof")

    def _body(self) -> dict[str, Any]:
        body = {**self._head(), "signed": [[k, v] for k, v in self.signed.items()]}
        if self.certificates:
            body["certificates"] = [[k, v] for k, v in self.certificates.items()]
        if self.marks:
            body |= {"marks": self.marks, "root": self.root, "proof": self.proof}
        return body

    @classmethod
    def _from_envelope(cls, env: f.Envelope) -> Signatures:
        rows = table(env.take("signed"), field="signed", width=2)
        certificates = env.take_optional("certificates")
        held = [] if certificates is None else table(certificates, field="certificates", width=2)
        marks = env.take_optional("marks")
        if marks is None:
            return cls(**cls._take_head(env), signed=dict(rows), certificates=dict(held))
        return cls(**cls._take_head(env), signed=dict(rows), certificates=dict(held),
                   marks=marks, root=env.take("root"), proof=env.take("proof"))  # fmt: skip


def relayed(
    *, fleet: str, round: int, survivors: tuple[str, ...], signed: Mapping[str, bytes],
    certificates: Mapping[str, bytes], graph: Mapping[str, frozenset[str]],
    settings: SecAggSettings, devices: int,
) -> dict[str, Signatures]:  # fmt: skip
    """The coordinator's :class:`Signatures` for each signer of ``survivors``: whole, or
    compact where the openings a roster of ``devices`` asks for cost fewer bytes.
    ``certificates``: every advertiser's; each device gets its non-neighbours'."""
    try:
        draws: int | None = openings(devices=devices, colluding=settings.colluding,
                                     quorum=settings.fewest)  # fmt: skip
    except ValueError:  # no quorum rule to sample against (an unsigned fleet's table)
        draws = None

    def certs(u: str, ids: Iterable[str]) -> dict[str, bytes]:
        return {v: certificates[v] for v in ids
                if v in certificates and v not in graph[u] and v != u}  # fmt: skip

    size = sum(len(p) + len(certificates.get(v, b"")) for v, p in signed.items())
    if draws is None or not compact_pays(signers=len(signed), draws=draws,
                                         entry_bytes=size / max(len(signed), 1)):  # fmt: skip
        return {u: Signatures(fleet=fleet, round=round, client=u, signed=signed,
                              certificates=certs(u, signed)) for u in sorted(signed)}  # fmt: skip
    names = [v for v in survivors if v in signed]
    marks = marks_of(survivors, signed)
    tree = levels([leaf(signed[v]) for v in names])
    root = tree[-1][0]
    commit = commitment(list_digest(survivors), marks, root)
    out = {}
    for u in sorted(signed):
        opened = {names[p]: p for p in positions(commit, client=u, count=len(names), draws=draws)}
        out[u] = Signatures(
            fleet=fleet, round=round, client=u, signed={v: signed[v] for v in opened},
            certificates=certs(u, opened), marks=marks, root=root,
            proof=multipath(tree, opened.values()),
        )  # fmt: skip
    return out


def unsigned_problem(
    signatures: Signatures, *, survivors: tuple[str, ...], roster: bytes, fleet: str,
    round: int, threshold: int, enrolment: Enrolment | None, least: str = "",
    certificates: Mapping[str, bytes] | None = None, client: str = "", devices: int = 0,
    colluding: int = 0,
) -> tuple[str, str | None] | None:  # fmt: skip
    """Why ``signatures`` do not show ``threshold`` survivors signing ``survivors``, with
    the device to blame if one; None if they do. Every entry must be a survivor's
    :class:`Consistency` of this round naming that very list and ``roster``, and, with
    ``enrolment``, signed under the fleet CA's certificate for its sender: from
    ``certificates`` (the device's own and its neighbours'), else as relayed. ``least``:
    how the refusal names ``threshold`` (``T = 900``; ``t = ...`` by default). Compact
    evidence is checked for ``client`` (the recipient) with the draws its roster of
    ``devices`` and ``colluding`` call for (secagg/evidence.py)."""
    listed = list_digest(survivors)
    known = dict(certificates or {})
    members = frozenset(survivors)
    least = least or f"t = {threshold}"
    for v, payload in signatures.signed.items():
        try:
            message = Consistency.from_wire(payload, max_bytes=MAX_ADVERT_BYTES)
        except ProtocolError as exc:
            return f"a survivor's signed list does not decode ({exc.reason})", v
        if (message.fleet, message.round, message.client) != (fleet, round, v):
            return "a survivor's signed list is another device's or another round's", v
        if v not in members:
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
    if signatures.marks:
        return _compact_problem(signatures, survivors=survivors, listed=listed,
                                threshold=threshold, least=least, client=client,
                                devices=devices, colluding=colluding)  # fmt: skip
    if len(signatures.signed) < threshold:
        count = len(signatures.signed)
        return f"{count} survivors signed its survivor list, fewer than {least}", None
    return None


def _compact_problem(
    signatures: Signatures, *, survivors: tuple[str, ...], listed: bytes, threshold: int,
    least: str, client: str, devices: int, colluding: int,
) -> tuple[str, str | None] | None:  # fmt: skip
    """Why compact evidence fails: marks that do not fit the list, fewer than ``T`` of
    them, this device unmarked, other entries opened than its draws call for, or one not
    under the root. The coordinator's faults all: nobody else is blamed."""
    try:
        names = marked(survivors, signatures.marks)
        draws = openings(devices=devices, colluding=colluding, quorum=threshold)
    except (FieldError, ValueError) as exc:
        return f"its compact evidence does not hold ({exc})", None
    if len(names) < threshold:
        return (
            f"{len(names)} survivors marked as signing its survivor list, fewer than {least}",
            None,
        )
    if client not in names:
        return "its own signed survivor list is not marked among the signatures", None
    commit = commitment(listed, signatures.marks, signatures.root)
    wanted = {names[p]: p for p in positions(commit, client=client, count=len(names), draws=draws)}
    if signatures.signed.keys() != wanted.keys():
        return "the signed lists opened are not those its draws call for", None
    opened = {p: leaf(signatures.signed[v]) for v, p in wanted.items()}
    if multiroot(opened, count=len(names), proof=signatures.proof) != signatures.root:
        return "the signed lists opened are not under the committed root", None
    return None
