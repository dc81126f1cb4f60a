"""Masks that hide each device's input in the ring ``Z_{2^k}`` and cancel in the sum.

Bonawitz et al. (CCS 2017): device ``u`` sends
``y_u = x_u + PRG(b_u) + sum_{v neighbour} delta_uv * PRG(s_uv)  (mod 2^k)``, where ``b_u``
is its own seed (the self mask), ``s_uv`` the X25519 secret it shares with ``v``, and
``delta_uv = +1`` if ``u < v`` else ``-1``: the lower id adds each pairwise mask and the
higher subtracts it, so every pair of survivors cancels in the sum. The server then removes
the survivors' self masks (seeds rebuilt from Shamir shares) and the masks each survivor
shared with a device that dropped after masking (that device's key rebuilt the same way).
With SecAgg+ (Bell et al., CCS 2020) the neighbours are a sparse graph instead of all
devices; nothing here assumes which.

The PRG is ChaCha20 under a key derived by HKDF-SHA256 from the seed and a context naming
the fleet, the round, the purpose and (for pairs) both ids. Each key is thus used for one
stream only, so a fixed all-zero nonce is safe, and a seed reused across rounds or purposes
still gives unrelated masks. The keystream is read as little-endian ``uint32`` or
``uint64`` words.

Arithmetic is numpy's on unsigned arrays, which wraps modulo ``2^k`` by definition;
:func:`ring_add` and :func:`ring_sub` insist both sides are the same ring so that a stray
``int64`` or ``float`` can never slip in and silently change the modulus.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

Bits = Literal[32, 64]
#: The ring's dtype for each supported width; little-endian words from the keystream.
RING_DTYPES: dict[int, np.dtype[np.unsignedinteger]] = {32: np.dtype("<u4"), 64: np.dtype("<u8")}
SEED_BYTES = 32
_LABEL = b"protofleet/secagg/mask/v1"
# The 16-byte ChaCha20 nonce of `cryptography` (4-byte little-endian block counter, then
# RFC 8439's 12-byte nonce): all zero, since every derived key makes exactly one stream.
_NONCE = bytes(16)


@dataclass(frozen=True, kw_only=True)
class MaskContext:
    """Whose masks these are: the fleet and round they belong to, bound into every key so a
    mask never repeats across fleets or rounds."""

    fleet: str
    round: int

    def __post_init__(self) -> None:
        if not self.fleet:
            raise ValueError("mask context needs a fleet name")
        if self.round < 0:
            raise ValueError(f"mask context round {self.round} is negative")

    def info(self, purpose: str, *ids: int) -> bytes:
        """The HKDF ``info`` string: each field length-prefixed, so no two contexts encode
        to the same bytes (``fleet="a", round=12`` and ``fleet="a1", round=2`` differ)."""
        fields = [self.fleet.encode(), str(self.round).encode(), purpose.encode()]
        fields += [str(i).encode() for i in ids]
        return _LABEL + b"".join(len(f).to_bytes(2, "big") + f for f in fields)


def ring_dtype(bits: int) -> np.dtype[np.unsignedinteger]:
    try:
        return RING_DTYPES[bits]
    except KeyError:
        raise ValueError(f"ring width {bits} is not one of {sorted(RING_DTYPES)}") from None


def ring_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b mod 2^k``."""
    _same_ring(a, b)
    return np.add(a, b, dtype=a.dtype)


def ring_sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a - b mod 2^k``."""
    _same_ring(a, b)
    return np.subtract(a, b, dtype=a.dtype)


def keystream_words(key: bytes, *, length: int, bits: Bits) -> np.ndarray:
    """The first ``length`` words of ChaCha20's keystream under ``key`` (zero nonce, block
    counter from 0), read as little-endian unsigned ``bits``-bit integers."""
    if len(key) != 32:
        raise ValueError(f"a ChaCha20 key is 32 bytes, not {len(key)}")
    if length < 0:
        raise ValueError(f"mask length {length} is negative")
    dtype = ring_dtype(bits)
    encryptor = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor()
    stream = encryptor.update(bytes(length * dtype.itemsize))
    return np.frombuffer(stream, dtype=dtype).copy()


def derive_key(seed: bytes, *, info: bytes) -> bytes:
    """The 32-byte ChaCha20 key for one stream: HKDF-SHA256 of ``seed`` under ``info``."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed is {SEED_BYTES} bytes, not {len(seed)}")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(seed)


def self_mask(seed: bytes, *, me: int, length: int, bits: Bits, context: MaskContext) -> np.ndarray:
    """``PRG(b_u)``: device ``me``'s own mask from its seed ``b_u``."""
    key = derive_key(seed, info=context.info("self", me))
    return keystream_words(key, length=length, bits=bits)


def seed_commitment(seed: bytes, *, client: str, context: MaskContext) -> bytes:
    """A device's commitment to its self-mask seed ``b_u``, sent with its keys before any
    share: SHA-256 of the context, the device's id (its index is not known until the
    roster) and the seed. The seed is 32 random bytes, so the digest hides it; a seed the
    coordinator rebuilds from shares must hash to it, or a wrong share would pass silently
    when exactly ``t`` came back."""
    name = client.encode()
    head = context.info("seed-commitment") + len(name).to_bytes(2, "big") + name
    return hashlib.sha256(head + seed).digest()


def pair_secret(private: X25519PrivateKey, peer: X25519PublicKey) -> bytes:
    """``s_uv``: the X25519 secret two devices agree on; the same from either side."""
    return private.exchange(peer)


def pair_mask(
    secret: bytes, *, me: int, peer: int, length: int, bits: Bits, context: MaskContext
) -> np.ndarray:
    """``delta * PRG(s_uv)`` as device ``me`` applies it: the mask itself when ``me`` is the
    lower id, its negation mod ``2^k`` when the higher."""
    if me == peer:
        raise ValueError(f"device {me} cannot share a pairwise mask with itself")
    low, high = min(me, peer), max(me, peer)
    key = derive_key(secret, info=context.info("pair", low, high))
    words = keystream_words(key, length=length, bits=bits)
    return words if me < peer else ring_sub(np.zeros_like(words), words)


def mask_input(
    x: np.ndarray,
    *,
    me: int,
    self_seed: bytes,
    pair_secrets: Mapping[int, bytes],
    context: MaskContext,
) -> np.ndarray:
    """``y_u``: the encoded input ``x`` (a ring vector) plus device ``me``'s self mask and
    its pairwise mask with every neighbour in ``pair_secrets`` (neighbour id -> ``s_uv``)."""
    bits = _bits_of(x)
    y = ring_add(x, self_mask(self_seed, me=me, length=x.size, bits=bits, context=context))
    for peer, secret in sorted(pair_secrets.items()):
        mask = pair_mask(secret, me=me, peer=peer, length=x.size, bits=bits, context=context)
        y = ring_add(y, mask)
    return y


def unmask_sum(
    masked_sum: np.ndarray,
    *,
    self_seeds: Mapping[int, bytes],
    dangling: Mapping[tuple[int, int], bytes],
    context: MaskContext,
) -> np.ndarray:
    """The sum of the survivors' inputs from the sum of their ``y_u``.

    ``self_seeds``: each survivor's rebuilt ``b_u``. ``dangling``: for each survivor ``u``
    and each neighbour ``v`` of it that dropped after the keys went out, ``(u, v) -> s_uv``
    (from ``v``'s rebuilt key); ``u``'s mask with ``v`` had no partner in the sum."""
    bits = _bits_of(masked_sum)
    n = masked_sum.size
    total = masked_sum
    for me, seed in sorted(self_seeds.items()):
        total = ring_sub(total, self_mask(seed, me=me, length=n, bits=bits, context=context))
    for (me, peer), secret in sorted(dangling.items()):
        mask = pair_mask(secret, me=me, peer=peer, length=n, bits=bits, context=context)
        total = ring_sub(total, mask)
    return total


def _bits_of(a: np.ndarray) -> Bits:
    if a.dtype == RING_DTYPES[32]:
        return 32
    if a.dtype == RING_DTYPES[64]:
        return 64
    raise TypeError(f"{a.dtype} is not a ring dtype (uint32 or uint64)")


def _same_ring(a: np.ndarray, b: np.ndarray) -> None:
    _bits_of(a)
    if a.dtype != b.dtype or a.shape != b.shape:
        raise TypeError(f"ring operands differ: {a.dtype}{a.shape} and {b.dtype}{b.shape}")
