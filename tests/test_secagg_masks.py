"""The mask generator: ChaCha20 known answers, the key derivation rebuilt by hand, modular
add and subtract by hand, and pairwise masks cancelling across five devices, with and
without a dropout."""

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secagg.masks import (
    MaskContext,
    keystream_words,
    mask_input,
    pair_mask,
    pair_secret,
    ring_add,
    ring_sub,
    self_mask,
    unmask_sum,
)

CTX = MaskContext(fleet="lab", round=3)
U32 = 2**32


def test_keystream_matches_rfc8439_zero_key_vector_as_little_endian_words() -> None:
    # RFC 8439 A.1, test vector 1 (key and nonce all zero, counter 0), first 16 bytes:
    # 76 b8 e0 ad | a0 f1 3d 90 | 40 5d 6a e5 | 53 86 bd 28
    words = keystream_words(bytes(32), length=4, bits=32)
    assert words.dtype == np.dtype("<u4")
    assert words.tolist() == [0xADE0B876, 0x903DF1A0, 0xE56A5D40, 0x28BD8653]
    wide = keystream_words(bytes(32), length=2, bits=64)
    assert wide.tolist() == [0x903DF1A0ADE0B876, 0x28BD8653E56A5D40]


def test_keystream_of_a_longer_vector_continues_the_same_stream() -> None:
    # 20 words span two 64-byte ChaCha20 blocks; the prefix must not depend on the length.
    key = bytes(range(32))
    assert keystream_words(key, length=20, bits=32)[:3].tolist() == (
        keystream_words(key, length=3, bits=32).tolist()
    )


def test_context_info_is_length_prefixed_as_documented() -> None:
    assert CTX.info("self", 2) == (
        b"protofleet/secagg/mask/v1\x00\x03lab\x00\x013\x00\x04self\x00\x012"
    )
    # Without the prefixes these two would encode the same fields "a" "12" / "a1" "2".
    assert MaskContext(fleet="a", round=12).info("self") != MaskContext(fleet="a1", round=2).info(
        "self"
    )


def test_self_mask_is_hkdf_then_chacha20_computed_independently() -> None:
    seed = bytes(range(100, 132))
    info = b"protofleet/secagg/mask/v1\x00\x03lab\x00\x013\x00\x04self\x00\x012"
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(seed)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(28))
    expected = np.frombuffer(stream, dtype="<u4")
    got = self_mask(seed, me=2, length=7, bits=32, context=CTX)
    np.testing.assert_array_equal(got, expected)


def test_masks_differ_by_round_device_and_purpose() -> None:
    seed = bytes(32)
    base = self_mask(seed, me=1, length=4, bits=64, context=CTX)
    other_round = self_mask(
        seed, me=1, length=4, bits=64, context=MaskContext(fleet="lab", round=4)
    )
    other_device = self_mask(seed, me=2, length=4, bits=64, context=CTX)
    as_pair = pair_mask(seed, me=1, peer=2, length=4, bits=64, context=CTX)
    for other in (other_round, other_device, as_pair):
        assert not np.array_equal(base, other)


def test_ring_add_and_subtract_wrap_as_worked_by_hand() -> None:
    a = np.array([U32 - 3, 5, 0], dtype=np.uint32)
    b = np.array([7, U32 - 5, 0], dtype=np.uint32)
    # (2^32 - 3) + 7 = 2^32 + 4 = 4; 5 + (2^32 - 5) = 2^32 = 0; 0 + 0 = 0.
    assert ring_add(a, b).tolist() == [4, 0, 0]
    # 2 - 5 = -3 = 2^32 - 3; 0 - 1 = 2^32 - 1; 9 - 9 = 0.
    c = np.array([2, 0, 9], dtype=np.uint32)
    d = np.array([5, 1, 9], dtype=np.uint32)
    assert ring_sub(c, d).tolist() == [U32 - 3, U32 - 1, 0]
    wide = np.array([2**64 - 1], dtype=np.uint64)
    assert ring_add(wide, np.array([2], dtype=np.uint64)).tolist() == [1]


def test_ring_operands_must_be_one_ring() -> None:
    a = np.zeros(3, dtype=np.uint32)
    with pytest.raises(TypeError):
        ring_add(a, np.zeros(3, dtype=np.int64))
    with pytest.raises(TypeError):
        ring_sub(a, np.zeros(3, dtype=np.uint64))
    with pytest.raises(TypeError):
        ring_add(np.zeros(3), np.zeros(3))


def test_the_lower_id_adds_the_pair_mask_and_the_higher_subtracts_it() -> None:
    secret = bytes(range(32))
    low = pair_mask(secret, me=2, peer=5, length=6, bits=32, context=CTX)
    high = pair_mask(secret, me=5, peer=2, length=6, bits=32, context=CTX)
    assert low.tolist() == [(U32 - int(w)) % U32 for w in high]
    assert low.any()
    assert ring_add(low, high).tolist() == [0] * 6
    with pytest.raises(ValueError, match="itself"):
        pair_mask(secret, me=2, peer=2, length=6, bits=32, context=CTX)


def fleet_keys(n: int) -> dict[int, X25519PrivateKey]:
    return {u: X25519PrivateKey.from_private_bytes(bytes([u]) * 32) for u in range(1, n + 1)}


def masked_fleet(bits: int, neighbours: dict[int, list[int]]):
    keys = fleet_keys(len(neighbours))
    rng = np.random.default_rng(11)
    dtype = np.uint32 if bits == 32 else np.uint64
    inputs = {u: rng.integers(0, 2**bits, size=9, dtype=dtype) for u in neighbours}
    seeds = {u: bytes([200 + u]) * 32 for u in neighbours}
    shared = {
        (u, v): pair_secret(keys[u], keys[v].public_key())
        for u in neighbours
        for v in neighbours[u]
    }
    masked = {
        u: mask_input(
            inputs[u],
            me=u,
            self_seed=seeds[u],
            pair_secrets={v: shared[u, v] for v in neighbours[u]},
            context=CTX,
        )
        for u in neighbours
    }
    return inputs, seeds, shared, masked


def ring_sum(vectors):
    vectors = list(vectors)
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total = ring_add(total, v)
    return total


@pytest.mark.parametrize("bits", [32, 64])
def test_pairwise_masks_cancel_across_five_devices(bits: int) -> None:
    everyone = {u: [v for v in range(1, 6) if v != u] for u in range(1, 6)}
    inputs, seeds, shared, masked = masked_fleet(bits, everyone)
    assert shared[1, 4] == shared[4, 1]
    for u in everyone:
        assert not np.array_equal(masked[u], inputs[u])
    total = unmask_sum(ring_sum(masked.values()), self_seeds=seeds, dangling={}, context=CTX)
    np.testing.assert_array_equal(total, ring_sum(inputs.values()))


def test_the_masks_a_dropped_device_left_behind_are_removed() -> None:
    # SecAgg+'s sparse graph: a ring of five, each device paired with its two neighbours.
    ring = {u: [(u % 5) + 1, ((u - 2) % 5) + 1] for u in range(1, 6)}
    inputs, seeds, shared, masked = masked_fleet(32, ring)
    survivors = [1, 2, 3, 5]  # 4 dropped after the keys went out, before sending y_4
    masked_sum = ring_sum(masked[u] for u in survivors)
    dangling = {(u, 4): shared[u, 4] for u in survivors if 4 in ring[u]}
    assert sorted(dangling) == [(3, 4), (5, 4)]
    total = unmask_sum(
        masked_sum, self_seeds={u: seeds[u] for u in survivors}, dangling=dangling, context=CTX
    )
    np.testing.assert_array_equal(total, ring_sum(inputs[u] for u in survivors))
    # Without removing the dangling masks the sum is garbage.
    wrong = unmask_sum(
        masked_sum, self_seeds={u: seeds[u] for u in survivors}, dangling={}, context=CTX
    )
    assert not np.array_equal(wrong, total)


def test_bad_seeds_keys_and_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        self_mask(bytes(16), me=1, length=3, bits=32, context=CTX)
    with pytest.raises(ValueError, match="32 bytes"):
        keystream_words(bytes(31), length=3, bits=32)
    with pytest.raises(ValueError, match="ring width"):
        keystream_words(bytes(32), length=3, bits=16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fleet"):
        MaskContext(fleet="", round=1)
    with pytest.raises(ValueError, match="negative"):
        MaskContext(fleet="lab", round=-1)
