"""Sealing Shamir shares for one neighbour: X25519, HKDF-SHA256, ChaCha20-Poly1305.

Device ``u`` encrypts its shares for neighbour ``v`` under a key derived by HKDF-SHA256
from the X25519 secret of ``u``'s and ``v``'s encryption keys (``c``), with an ``info``
naming the fleet, the round, the sender and the recipient; the same bytes are the AEAD's
associated data. X25519 gives both directions of a pair the same secret, so naming the
sender keeps ``u -> v`` and ``v -> u`` under different keys; naming the round and fleet
keeps a ciphertext from being replayed elsewhere, and the coordinator that relays it
cannot redirect it to another recipient or pass it off as another sender's.

Each derived key seals exactly one message (a device shares once per round, with fresh
keys each round), so the nonce is fixed at zero, as for the masks' ChaCha20 streams.
ChaCha20-Poly1305 rather than AES-GCM: it is constant-time in software on the edge
devices' CPUs that lack AES instructions, and it is the same cipher as the mask generator.

The plaintext is the two share values, each ``SHARE_BYTES`` big-endian: first the share
of the self-mask seed ``b_u``, then that of the masking key ``s_u``. The x-coordinate is
the recipient's public index and the threshold a public setting, so neither is sent.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secagg.messages import SHARE_BYTES
from secagg.shamir import Share

_LABEL = b"protofleet/secagg/share/v1"
_NONCE = bytes(12)
#: Both shared secrets are 32 bytes: a self-mask seed and an X25519 private key.
SECRET_BYTES = 32


def pair_context(*, fleet: str, round: int, sender: str, recipient: str) -> bytes:
    """The HKDF ``info`` and AEAD associated data for ``sender``'s shares to
    ``recipient``: each field length-prefixed, so no two contexts encode alike."""
    fields = [fleet.encode(), str(round).encode(), sender.encode(), recipient.encode()]
    return _LABEL + b"".join(len(f).to_bytes(2, "big") + f for f in fields)


def seal(
    plaintext: bytes, *, private: X25519PrivateKey, peer: X25519PublicKey, context: bytes
) -> bytes:
    """Encrypt and authenticate ``plaintext`` for the holder of ``peer``. Raises
    :class:`ValueError` if ``peer`` is a low-order point (an all-zero shared secret)."""
    return _aead(private, peer, context).encrypt(_NONCE, plaintext, context)


def unseal(
    ciphertext: bytes, *, private: X25519PrivateKey, peer: X25519PublicKey, context: bytes
) -> bytes:
    """The plaintext ``peer``'s holder sealed; raises
    :class:`cryptography.exceptions.InvalidTag` if it was altered, sealed under another
    context or by another key, and :class:`ValueError` for a low-order ``peer``."""
    return _aead(private, peer, context).decrypt(_NONCE, ciphertext, context)


def share_value(share: Share) -> bytes:
    """A share's value as ``SHARE_BYTES`` big-endian bytes."""
    return share.y.to_bytes(SHARE_BYTES, "big")


def share_of(value: bytes, *, x: int, threshold: int) -> Share:
    """The share of a 32-byte secret held at ``x`` with value ``value``; raises
    :class:`ValueError` if the value is not in the field."""
    if len(value) != SHARE_BYTES:
        raise ValueError(f"a share value is {SHARE_BYTES} bytes, not {len(value)}")
    return Share(x=x, y=int.from_bytes(value, "big"), threshold=threshold, size=SECRET_BYTES)


def pack_pair(seed: Share, key: Share) -> bytes:
    """The plaintext for one neighbour: its share of ``b_u``, then of ``s_u``."""
    return share_value(seed) + share_value(key)


def unpack_pair(plaintext: bytes, *, x: int, threshold: int) -> tuple[Share, Share]:
    """The shares of ``b_u`` and ``s_u`` from :func:`pack_pair`'s plaintext."""
    if len(plaintext) != 2 * SHARE_BYTES:
        raise ValueError(f"expected {2 * SHARE_BYTES} bytes of shares, got {len(plaintext)}")
    return (
        share_of(plaintext[:SHARE_BYTES], x=x, threshold=threshold),
        share_of(plaintext[SHARE_BYTES:], x=x, threshold=threshold),
    )


def _aead(private: X25519PrivateKey, peer: X25519PublicKey, context: bytes) -> ChaCha20Poly1305:
    secret = private.exchange(peer)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=context).derive(secret)
    return ChaCha20Poly1305(key)
