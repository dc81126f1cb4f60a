"""Signed messages: who sent an update, an announcement or a receipt.

A device signs its updates with its own key and the coordinator signs its announcements
and receipts with its key; the coordinator accepts updates only from enrolled devices'
keys, and a device accepts announcements and receipts only under the coordinator key it
has pinned. Keys are PEM files: Ed25519, or the EC P-256 keys ``systemd/make-certs.sh``
issues for TLS (then signed with ECDSA over SHA-256), so one identity serves both. Public
keys may be given as PEM public keys or as certificates (their key is used; enrolment is
the file's presence, revocation its removal).

A signature covers a *statement* naming the message kind, fleet, round, client, the
coordinator's run id and the SHA-256 of the message's encoding without its signature:
re-stamping a captured update with another round or run, or another device's name,
breaks it. The run id is drawn when a coordinator's database is created, so an update
from an earlier life of the fleet cannot be replayed into a new one.

``cryptography`` is imported here only, and lazily: the protocol package itself still
needs only numpy and msgpack. Reading and writing key files is the services' business
(runtime/keyfiles.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from protocol import fields as f
from protocol.codec import pack
from protocol.errors import FieldError
from protocol.ids import validate_id

M = TypeVar("M")

#: Ed25519 signatures are 64 bytes, DER-encoded ECDSA P-256 ones at most 72.
MAX_SIGNATURE_BYTES = 80
_DOMAIN = "protofleet-signature-v1"


class KeyFileError(ValueError):
    """A key file cannot be read or is not a usable key; the message names the file."""


@dataclass(frozen=True, eq=True)
class Auth:
    """The signed trailer of a message: the coordinator run it belongs to, and the
    signature of its statement."""

    run: str
    signature: bytes

    def __post_init__(self) -> None:
        validate_id(self.run, field="auth.run")
        if not isinstance(self.signature, bytes) or not 0 < len(self.signature) <= (
            MAX_SIGNATURE_BYTES
        ):
            raise FieldError(
                f"expected 1-{MAX_SIGNATURE_BYTES} bytes of signature", field="auth.signature"
            )

    def to_obj(self) -> dict[str, Any]:
        return {"run": self.run, "sig": self.signature}

    @classmethod
    def from_obj(cls, obj: object) -> Auth:
        m = f.mapping(obj, field="auth", max_length=2)
        if set(m) != {"run", "sig"}:
            raise FieldError("must have exactly run, sig", field="auth")
        return cls(run=m["run"], signature=m["sig"])


def statement(*, kind: str, fleet: str, round_: int, client: str, run: str, body: bytes) -> bytes:
    """The bytes a signature covers; ``body`` is the message encoded without its auth."""
    digest = hashlib.sha256(body).digest()
    return pack({"d": _DOMAIN, "k": kind, "f": fleet, "r": round_, "c": client, "u": run,
                 "h": digest})  # fmt: skip


class Signer:
    """A private key that signs statements (Ed25519, or ECDSA P-256 with SHA-256)."""

    def __init__(self, key: Any) -> None:
        from cryptography.hazmat.primitives.asymmetric import ec, ed25519

        if isinstance(key, ed25519.Ed25519PrivateKey):
            self._sign = key.sign
        elif isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1":
            from cryptography.hazmat.primitives import hashes

            self._sign = lambda data: key.sign(data, ec.ECDSA(hashes.SHA256()))
        else:
            raise KeyFileError("only Ed25519 and EC P-256 keys are supported")
        self.public = Verifier(key.public_key())

    def sign(self, data: bytes) -> bytes:
        return bytes(self._sign(data))


class Verifier:
    """A public key that checks statements; :meth:`verify` never raises."""

    def __init__(self, key: Any) -> None:
        from cryptography.hazmat.primitives.asymmetric import ec, ed25519

        self._verify: Callable[[bytes, bytes], object]
        if isinstance(key, ed25519.Ed25519PublicKey):
            self._verify = key.verify
        elif isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1":
            from cryptography.hazmat.primitives import hashes

            self._verify = lambda sig, data: key.verify(sig, data, ec.ECDSA(hashes.SHA256()))
        else:
            raise KeyFileError("only Ed25519 and EC P-256 keys are supported")

    def verify(self, signature: bytes, data: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._verify(signature, data)
        except InvalidSignature:
            return False
        return True


def _statement_of(message: Any, run: str) -> bytes:
    unsigned = message if message.auth is None else dataclasses.replace(message, auth=None)
    return statement(
        kind=message.KIND,
        fleet=message.fleet,
        round_=message.round,
        client=getattr(message, "client", ""),
        run=run,
        body=unsigned.to_wire(),
    )


def sign(message: M, signer: Signer, *, run: str) -> M:
    """``message`` (an update, announcement or receipt) with its signed ``auth``."""
    signature = signer.sign(_statement_of(message, run))
    return dataclasses.replace(message, auth=Auth(run=run, signature=signature))  # type: ignore[type-var]


def signature_problem(message: Any, verifier: Verifier | None, *, run: str | None) -> str | None:
    """Why ``message`` is not signed by ``verifier``'s key for coordinator run ``run``
    (None: any run), or None if it is. The reasons are rejection counters' names."""
    auth = message.auth
    if auth is None:
        return "unsigned"
    if verifier is None:
        return "unenrolled"
    if run is not None and auth.run != run:
        return "wrong_run"
    if not verifier.verify(auth.signature, _statement_of(message, auth.run)):
        return "bad_signature"
    return None
