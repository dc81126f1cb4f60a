"""Neighbours' keys bound to enrolled devices by the fleet CA, an authority the
coordinator does not hold (issue 51).

Without it a roster's keys are the coordinator's word: it could put its own keys under a
real neighbour's id, or invent neighbours, play every one of them and unmask one device's
input alone, whatever ``t`` is (docs/privacy.md). So in a signed fleet each device signs
its advertisement with its enrolled device key (:func:`protocol.auth.sign`: fleet, round,
client and coordinator run, over the whole advertisement: both public keys, the table
digest, the seed commitment and the certificate) and sends with it the certificate the
fleet CA issued it (``systemd/make-certs.sh``'s ``clients/<id>.crt``), which binds its id
(the CN) to that key. The roster relays each neighbour's advertisement as signed, and a
device checks every one against the CA it pinned (:meth:`Enrolment.problem`) before any
share leaves it.

The CA's private key stays with the operator (make-certs.sh's ``ca/ca.key``); the
coordinator gets only ``ca.crt``. A coordinator that can issue certificates can pose as
every device, so this holds only while the CA key is kept off it. Revocation is the
coordinator's (its ``security.crl``): a device does not read the CRL, so a revoked
device's certificate still passes a neighbour's check until it expires; what that allows
is the revoked device's own keys in a round, not the coordinator's.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from protocol.auth import Signer, Verifier, sign, signature_problem
from protocol.errors import ProtocolError
from protocol.ids import validate_id
from secagg.messages import MAX_ADVERT_BYTES, Advertise, PublicKeys

M = TypeVar("M")


def enrolled_key(
    certificate: bytes, *, client: str, ca: x509.Certificate, now: datetime.datetime
) -> Verifier | str:
    """The signing key ``ca`` bound to ``client`` by ``certificate`` (DER), or why it
    binds none."""
    if not certificate:
        return "carries no certificate"
    try:
        cert = x509.load_der_x509_certificate(certificate)
    except ValueError:
        return "carries a certificate that does not parse"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "carries a certificate the fleet CA did not issue"
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    if [str(n.value) for n in names] != [client]:
        return "carries a certificate issued to another device"
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        return "carries a certificate outside its validity"
    try:
        return Verifier(cert.public_key())
    except ValueError:
        return "carries a certificate for a key that cannot sign"


@dataclass(frozen=True, kw_only=True)
class Enrolment:
    """What device ``client`` of a signed fleet takes part in a round with: ``signer``,
    its enrolled device key; ``certificate``, the fleet CA's certificate for it (DER);
    ``ca``, the fleet CA it pinned; ``run``, the coordinator run of the round. ``clock``
    gives the time certificates are checked at (tests inject one)."""

    client: str
    signer: Signer
    certificate: bytes
    ca: x509.Certificate
    run: str
    clock: datetime.datetime | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        validate_id(self.client, field="client")
        validate_id(self.run, field="run")
        own = enrolled_key(self.certificate, client=self.client, ca=self.ca, now=self.now())
        if isinstance(own, str):
            raise ValueError(f"this device's certificate is refused: it {own}")
        probe = b"protofleet-enrolment-probe"
        if not own.verify(self.signer.sign(probe), probe):
            # Every neighbour would refuse this device's advertisements: say so here.
            raise ValueError("this device's certificate is not for its signing key")

    def now(self) -> datetime.datetime:
        return self.clock or datetime.datetime.now(datetime.timezone.utc)

    def sign(self, message: M) -> M:
        """``message`` (an advertisement, a signed survivor list) signed for the run, with
        this device's certificate where it carries one (an advertisement)."""
        if hasattr(message, "certificate"):
            message = replace(message, certificate=self.certificate)  # type: ignore[type-var]
        return sign(message, self.signer, run=self.run)

    def vouches(self, message: Any, *, certificate: bytes | None = None) -> str | None:
        """Why ``message`` (with ``client`` and ``auth``) is not signed, for this run, by the
        key the pinned CA bound to its ``client`` in ``certificate`` (by default the
        message's own, an advertisement's); None if it is."""
        certificate = message.certificate if certificate is None else certificate
        key = enrolled_key(certificate, client=message.client, ca=self.ca, now=self.now())
        if isinstance(key, str):
            return key
        why = signature_problem(message, key, run=self.run)
        return None if why is None else f"is not signed by its enrolled key ({why})"

    def vouched(
        self, payload: bytes | None, *, client: str, fleet: str, round: int, keys: PublicKeys
    ) -> Advertise | str:
        """``payload`` as ``client``'s signed advertisement of ``keys`` for this round of
        ``fleet`` and this run, under a certificate of the pinned CA; or why it is not."""
        if payload is None:
            return "is not relayed"
        try:
            advert = Advertise.from_wire(payload, max_bytes=MAX_ADVERT_BYTES)
        except ProtocolError as exc:
            return f"does not decode ({exc.reason})"
        if (advert.fleet, advert.round, advert.client) != (fleet, round, client):
            return "is another device's or another round's"
        if advert.keys != keys:
            return "is for other keys than the roster's"
        why = self.vouches(advert)
        return advert if why is None else why
