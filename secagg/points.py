"""Which X25519 public keys a party refuses: those of small order, the identity among them.

A key of small order makes every X25519 agreement with it a fixed, public value (all
zeros), whatever the other side's private key: shares sealed to it, or masks agreed with
it, would be readable by anyone. The device refuses such a neighbour key when it reads a
roster, before any share leaves it, and the coordinator refuses such an advertisement
(secagg/device.py, secagg/server.py).

The test is one agreement with a fixed private key. X25519 clamps every scalar to ``8 m``
with ``2^251 <= m < 2^252``, below the prime order of the curve's large subgroup
(``2^252 + ...``) and of its twist's (about ``2^253``), so ``8 m P`` is the identity,
the all-zero output the ``cryptography`` library refuses with :class:`ValueError`,
exactly when the order of ``P`` divides 8: every low-order point of the curve and of its
twist, whatever its encoding (``u >= p``, the top bit set), and no other point.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

# Any scalar does (module text); this one is public on purpose.
_PROBE = X25519PrivateKey.from_private_bytes(bytes(range(32)))


def small_order(public: bytes) -> bool:
    """Whether the 32-byte X25519 public key ``public`` is a point of small order."""
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        return True
    return False
