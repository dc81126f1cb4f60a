"""Compact evidence that at least ``T`` survivors signed a survivor list (issue 52).

The consistency stage (secagg/consistency.py) lets a device release shares only once
``T`` survivors have signed the very list it holds. Sent whole, that evidence is ``T``
signed digests (and, on a sparse graph, ``T`` certificates): about 180 bytes a survivor,
1.8 MB a device at 10,000 devices, and ``T`` signature checks on every device.

The compact form commits to all of it and opens a sample. The coordinator marks which
listed survivors signed (a bitmap over the list, ``marks``), hashes each marked
survivor's signed digest into a Merkle tree in list order, and commits to the list, the
marks and the tree's root together (:func:`commitment`). The positions to open are drawn
from that commitment and the recipient's id (:func:`positions`), so the coordinator
cannot choose them; it sends each opened entry with its path to the root. The device
checks that the marks name at least ``T`` of its list, itself among them, and that every
drawn entry is the marked survivor's own signature on its list, under the root.

**Why it binds.** Two survivor lists both passing need, by the quorum rule ``2T > n + c``
(secagg/settings.py), one of them to hold at most ``(n + c) / 2`` real signatures (honest
devices sign one list, colluders any): its marks, ``T`` or more, are then at least a
share ``1 - f`` forged, ``f = (n + c) / (2T) < 1``. A forged mark is caught when drawn: no
one but the marked device can sign for it, and a leaf cannot be committed before the
signature it hashes exists (Ed25519 signatures are not predictable without the key).
Each draw is uniform given the commitment (SHA-256 as a random oracle), so one commitment
passes a device's ``m`` draws with probability at most ``f^m``; ``m`` is chosen
(:func:`openings`) so that ``f^m <= 2^-SOUNDNESS_BITS``: a coordinator that recomputes the
commitment 2^64 times (changing a forged leaf's bytes) passes with probability 2^-64 at
most. The device derives ``m`` from public facts (its roster's size, ``c``, ``T``), never
from what the coordinator says. Bonawitz et al.'s protocol sends every signature; the
sampling is this project's, in the manner of compact certificates (Micali, Reyzin,
Vlachos, Wahby and Zeldovich, 2021): the same grinding argument, without weights.

The coordinator sends the whole evidence where that is smaller (small fleets):
:func:`compact_pays`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence

from protocol.errors import FieldError

#: Draws per device: a commitment passes them with probability at most 2^-SOUNDNESS_BITS.
SOUNDNESS_BITS = 128
HASH_BYTES = 32
_DOMAIN = b"protofleet/secagg/evidence/v1"
_LEAF, _NODE = b"\x00", b"\x01"


def openings(*, devices: int, colluding: int, quorum: int) -> int:
    """``m``: how many entries a device draws, for a roster of ``devices``, ``colluding``
    (c) and the quorum ``T``: the least ``m`` with ``f^m <= 2^-SOUNDNESS_BITS``, ``f =
    (n + c) / (2T)``. Raises ValueError when ``2T <= n + c`` (no bound: a signed device
    refuses such a table before any share leaves it)."""
    if devices < 1 or colluding < 0 or quorum < 1:
        raise ValueError(
            f"need devices, quorum >= 1 and colluding >= 0: {devices}, {colluding}, {quorum}"
        )
    f = (devices + colluding) / (2 * quorum)
    if f >= 1:
        raise ValueError(f"T = {quorum} is not above half of n + c = {devices + colluding}")
    return math.ceil(SOUNDNESS_BITS / -math.log2(f))


def marks_of(listed: Sequence[str], signers: Mapping[str, object]) -> bytes:
    """The bitmap over ``listed`` (in order, bit ``i % 8`` of byte ``i // 8``) of those
    in ``signers``."""
    out = bytearray((len(listed) + 7) // 8)
    for i, v in enumerate(listed):
        if v in signers:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def marked(listed: Sequence[str], marks: bytes) -> list[str]:
    """The ids ``marks`` names, in list order; raises FieldError for a bitmap of the
    wrong length or with bits past the list's end."""
    if len(marks) != (len(listed) + 7) // 8:
        raise FieldError(
            f"expected {(len(listed) + 7) // 8} bytes for {len(listed)} survivors", field="marks"
        )
    tail = len(listed) & 7
    if tail and marks[-1] >> tail:
        raise FieldError("marks a survivor past the list's end", field="marks")
    return [v for i, v in enumerate(listed) if marks[i >> 3] >> (i & 7) & 1]


def leaf(payload: bytes) -> bytes:
    return hashlib.sha256(_LEAF + payload).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


def levels(leaves: list[bytes]) -> list[list[bytes]]:
    """The tree bottom up; a level's odd last node goes up unpaired."""
    if not leaves:
        raise ValueError("a tree needs at least one leaf")
    out = [leaves]
    while len(out[-1]) > 1:
        row = out[-1]
        out.append([_node(row[i], row[i + 1]) if i + 1 < len(row) else row[i]
                    for i in range(0, len(row), 2)])  # fmt: skip
    return out


def multipath(tree: list[list[bytes]], indices: Iterable[int]) -> bytes:
    """The nodes that lead leaves ``indices`` to the root, each once: level by level from
    the bottom, the sibling of each node on the way up (in index order) that no opened
    leaf gives already. A sample shares the tree's top levels, which one path per leaf
    would repeat (a tenth of a 10,000-device fleet's evidence)."""
    known, out = sorted(set(indices)), []
    for row in tree[:-1]:
        have, size = set(known), len(row)
        out += [row[i ^ 1] for i in known if i ^ 1 < size and i ^ 1 not in have]
        known = list(dict.fromkeys(i >> 1 for i in known))  # still sorted: halving keeps order
    return b"".join(out)


def multiroot(leaves: Mapping[int, bytes], *, count: int, proof: bytes) -> bytes | None:
    """The root ``proof`` (:func:`multipath`'s) leads to from ``leaves`` (index -> leaf
    hash) of ``count``; None when an index is out of range or the proof is not exactly
    the nodes they need."""
    if not leaves or any(not 0 <= i < count for i in leaves):
        return None
    known, used = dict(leaves), 0
    while count > 1:
        up: dict[int, bytes] = {}
        for i in sorted(known):
            if i >> 1 in up:
                continue  # its left sibling made the parent
            if i ^ 1 >= count:
                up[i >> 1] = known[i]
                continue
            sibling = known.get(i ^ 1)
            if sibling is None:
                sibling = proof[used : used + HASH_BYTES]
                if len(sibling) != HASH_BYTES:
                    return None
                used += HASH_BYTES
            up[i >> 1] = _node(sibling, known[i]) if i & 1 else _node(known[i], sibling)
        known, count = up, (count + 1) // 2
    return known[0] if used == len(proof) else None


def commitment(listed: bytes, marks: bytes, root: bytes) -> bytes:
    """What the draws come from: the list's digest, the marks and the tree's root."""
    return hashlib.sha256(_DOMAIN + listed + marks + root).digest()


def positions(commit: bytes, *, client: str, count: int, draws: int) -> list[int]:
    """The leaves ``client`` opens: ``draws`` uniform picks (with repeats, kept once) of
    ``count`` leaves from SHAKE-256 of the commitment and the id (a 64-bit word each,
    reduced: its bias, below 2^-50, is immaterial)."""
    stream = hashlib.shake_256(commit + client.encode()).digest(8 * draws)
    return sorted({int.from_bytes(stream[8 * i : 8 * i + 8], "big") % count for i in range(draws)})


def compact_pays(*, signers: int, draws: int, entry_bytes: float) -> bool:
    """Whether ``draws`` openings (each an entry of ``entry_bytes`` and, at most, a path of
    ``log2(signers)`` hashes) come to fewer bytes than every signer's entry."""
    depth = math.ceil(math.log2(max(signers, 2)))
    return draws * (entry_bytes + depth * HASH_BYTES) < signers * entry_bytes
