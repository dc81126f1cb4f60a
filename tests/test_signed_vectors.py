"""Signed test vectors (docs/vectors/signed.json): for an Ed25519 and an EC P-256 key, an
update, a round announcement and a receipt, with the encoding a signature hashes, the
statement it signs, the signature and the signed message, so a device written in another
language can check its own signer byte for byte (docs/protocol.md, "Signatures").

Ed25519 is deterministic: every byte is rebuilt and compared. ECDSA draws a fresh nonce
per signature, so for P-256 everything but the signature is rebuilt and compared, and the
published signature must verify. ``python -m tests.test_signed_vectors`` rewrites the file
after a deliberate format change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from protocol import PrototypeUpdate, RoundAnnouncement
from protocol.auth import Signer, Verifier, sign, signature_problem, statement
from protocol.receipts import Receipt
from tests import factories

VECTORS = Path(__file__).resolve().parent.parent / "docs" / "vectors" / "signed.json"
RUN = factories.RUN  # the run the messages name, and sign for
#: Fixed private keys: public test keys, never a deployment's.
ED25519_SEED = bytes(range(32))
P256_SCALAR = int("c9afa9d845ba75166b5c215767b1d6934e50c3db36e89b127b8a622b120f6721", 16)

MESSAGES: dict[str, Any] = {
    "update": (PrototypeUpdate, lambda: factories.update(auth=None)),
    "round": (RoundAnnouncement, lambda: factories.announcement()),
    "receipt": (
        Receipt,
        lambda: Receipt(fleet="lab", round=3, run=RUN, client="jetson-01", digest="ab" * 32),
    ),
}


def private_key(alg: str) -> Any:
    if alg == "ed25519":
        return ed25519.Ed25519PrivateKey.from_private_bytes(ED25519_SEED)
    return ec.derive_private_key(P256_SCALAR, ec.SECP256R1())


def public_pem(key: Any) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def vector(alg: str, kind: str) -> dict[str, Any]:
    """One vector, signed afresh (a new ECDSA nonce for P-256)."""
    _, make = MESSAGES[kind]
    message = make()
    key = private_key(alg)
    body = message.to_wire()
    signed = sign(message, Signer(key), run=RUN)
    said = statement(
        kind=message.KIND,
        fleet=message.fleet,
        round_=message.round,
        client=getattr(message, "client", ""),
        run=RUN,
        body=body,
    )
    return {
        "alg": alg,
        "kind": kind,
        "private_key": ED25519_SEED.hex() if alg == "ed25519" else f"{P256_SCALAR:064x}",
        "public_key_pem": public_pem(key),
        "run": RUN,
        "body": body.hex(),
        "statement": said.hex(),
        "signature": signed.auth.signature.hex(),
        "signed_message": signed.to_wire().hex(),
    }


CASES = [(alg, kind) for alg in ("ed25519", "p256") for kind in MESSAGES]


def published() -> dict[tuple[str, str], dict[str, Any]]:
    return {(v["alg"], v["kind"]): v for v in json.loads(VECTORS.read_text())["vectors"]}


def test_every_case_is_published():
    assert sorted(published()) == sorted(CASES)


@pytest.mark.parametrize(("alg", "kind"), CASES)
def test_a_vector_is_rebuilt_byte_for_byte(alg, kind):
    want = published()[(alg, kind)]
    got = vector(alg, kind)
    random_in_signature = {"signature", "signed_message"} if alg == "p256" else set()
    for field in sorted(set(want) - random_in_signature):
        assert got[field] == want[field], field
    cls, _ = MESSAGES[kind]
    message = cls.from_wire(bytes.fromhex(want["signed_message"]))
    assert message.auth.signature.hex() == want["signature"]
    public = serialization.load_pem_public_key(want["public_key_pem"].encode())
    # The published signature verifies, over exactly the published statement.
    assert Verifier(public).verify(
        bytes.fromhex(want["signature"]), bytes.fromhex(want["statement"])
    )
    assert signature_problem(message, Verifier(public), run=RUN) is None
    # One byte changed in the body hashed breaks it: the vector pins every byte.
    other = bytearray(bytes.fromhex(want["statement"]))
    other[-1] ^= 1
    assert not Verifier(public).verify(bytes.fromhex(want["signature"]), bytes(other))


if __name__ == "__main__":
    VECTORS.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "about": "ProtoFleet signed test vectors: docs/protocol.md, Signatures. The private "
        "keys are public test keys: 'private_key' is, for ed25519, the 32-byte RFC 8032 "
        "private key (the seed) and, for p256, the private scalar as 32 big-endian bytes. "
        "Hex strings are bytes; 'body' is the message encoded without auth, 'statement' "
        "the msgpack map a signature covers.",
        "vectors": [vector(alg, kind) for alg, kind in CASES],
    }
    VECTORS.write_text(json.dumps(document, indent=1) + "\n")
