"""Shamir sharing: a case worked by hand in Z_97, round trips in the 521-bit field, and
that t - 1 shares are consistent with every secret."""

import itertools
import random
from collections import Counter

import pytest

from secagg.shamir import P521, Share, combine, combine_points, interpolate, split


class Scripted(random.Random):
    """Hands out the polynomial's coefficients a_1, a_2, ... in the order given."""

    def __init__(self, values: list[int]) -> None:
        super().__init__(0)
        self.values = list(values)

    def randrange(self, *args, **kwargs) -> int:
        return self.values.pop(0)


# f(x) = 42 + 5x + 11x^2 over Z_97:
#   f(1) = 42 + 5 + 11 = 58
#   f(2) = 42 + 10 + 44 = 96
#   f(3) = 42 + 15 + 99 = 156 = 59 (mod 97)
#   f(4) = 42 + 20 + 176 = 238 = 44 (mod 97)
#   f(5) = 42 + 25 + 275 = 342 = 51 (mod 97)
HAND = {1: 58, 2: 96, 3: 59, 4: 44, 5: 51}


def hand_shares() -> dict[int, Share]:
    return split(bytes([42]), threshold=3, holders=[1, 2, 3, 4, 5], rng=Scripted([5, 11]), prime=97)


def test_split_evaluates_the_polynomial_worked_by_hand() -> None:
    assert {x: s.y for x, s in hand_shares().items()} == HAND


def test_combine_interpolates_at_zero_as_worked_by_hand() -> None:
    shares = hand_shares()
    # Holders 1, 2, 3: Lagrange weights at 0 are 2*3/((2-1)(3-1)) = 3, 1*3/((1-2)(3-2)) = -3
    # and 1*2/((1-3)(2-3)) = 1, so f(0) = 3*58 - 3*96 + 59 = -55 = 42 (mod 97).
    assert interpolate([(1, 58), (2, 96), (3, 59)], at=0, prime=97) == 42
    # Holders 2, 4, 5: weights 20/6 = 10/3, 10/(-2) = -5 and 8/3, so
    # f(0) = 10/3*96 - 5*44 + 8/3*51 = 320 - 220 + 136 = 236 = 42 (mod 97).
    assert interpolate([(2, 96), (4, 44), (5, 51)], at=0, prime=97) == 42
    for trio in itertools.combinations(shares.values(), 3):
        assert combine(trio) == bytes([42])


def test_two_shares_of_a_threshold_three_secret_fit_every_secret_equally() -> None:
    # For each candidate secret s, count the polynomials s + a1 x + a2 x^2 through the two
    # observed points (1, 58) and (2, 96): exactly one each, so the points say nothing.
    counts = Counter(
        s
        for s in range(97)
        for a1 in range(97)
        if (s + 2 * a1 + 4 * ((58 - s - a1) % 97)) % 97 == 96
    )
    assert counts == Counter({s: 1 for s in range(97)})


def test_two_holders_see_every_pair_of_values_once_whatever_the_secret() -> None:
    # Threshold 3: over all 97^2 coefficient pairs (a1, a2), the shares of holders 1 and 2
    # take every value pair in Z_97^2 exactly once, whatever the secret: they reveal nothing.
    everything = Counter(itertools.product(range(97), repeat=2))
    for secret in (0, 42, 96):
        seen: Counter[tuple[int, int]] = Counter()
        for a1, a2 in itertools.product(range(97), repeat=2):
            shares = split(
                bytes([secret]), threshold=3, holders=[1, 2, 3], rng=Scripted([a1, a2]), prime=97
            )
            seen[shares[1].y, shares[2].y] += 1
        assert seen == everything


def test_round_trip_of_32_byte_secrets_in_the_521_bit_field() -> None:
    rng = random.Random(7)
    holders = list(range(1, 11))
    for secret in (bytes(32), b"\xff" * 32, bytes([0, 0, 1] + [9] * 29), rng.randbytes(32)):
        shares = split(secret, threshold=6, holders=holders, rng=rng)
        assert all(s.prime == P521 and s.y < P521 for s in shares.values())
        for subset in (holders[:6], holders[4:], [1, 3, 5, 7, 9, 10]):
            assert combine(shares[x] for x in subset) == secret


def test_the_default_source_is_random_per_split() -> None:
    first = split(b"\x01" * 32, threshold=2, holders=[1, 2])
    second = split(b"\x01" * 32, threshold=2, holders=[1, 2])
    assert first[1].y != second[1].y
    assert combine(first.values()) == combine(second.values()) == b"\x01" * 32


def test_p521_passes_fermat_checks() -> None:
    assert P521 == 2**521 - 1 and P521 > 2**256
    assert all(pow(a, P521 - 1, P521) == 1 for a in (2, 3, 5, 7, 11, 13))


def test_too_few_shares_are_refused() -> None:
    shares = hand_shares()
    with pytest.raises(ValueError, match="2 shares given, 3 needed"):
        combine([shares[1], shares[4]])
    with pytest.raises(ValueError, match="no shares"):
        combine([])


def test_a_share_off_the_polynomial_is_detected() -> None:
    shares = hand_shares()
    bad = Share(x=5, y=(HAND[5] + 1) % 97, threshold=3, size=1, prime=97)
    with pytest.raises(ValueError, match="holder 5 does not lie"):
        combine([shares[1], shares[2], shares[3], bad])


def test_duplicate_and_zero_coordinates_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        split(b"\x01", threshold=2, holders=[1, 2, 2], prime=97)
    with pytest.raises(ValueError, match="0"):
        split(b"\x01", threshold=2, holders=[0, 1, 2], prime=97)
    with pytest.raises(ValueError, match="0"):
        split(b"\x01", threshold=2, holders=[97, 1, 2], prime=97)
    shares = hand_shares()
    with pytest.raises(ValueError, match="duplicate"):
        combine([shares[1], shares[1], shares[2]])
    with pytest.raises(ValueError, match="x-coordinate 0"):
        Share(x=0, y=1, threshold=2, size=1, prime=97)


def test_threshold_out_of_range_is_refused() -> None:
    for threshold in (0, 1, 4):
        with pytest.raises(ValueError, match="threshold"):
            split(b"\x01", threshold=threshold, holders=[1, 2, 3], prime=97)


def test_a_secret_too_large_for_the_field_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        split(bytes([97]), threshold=2, holders=[1, 2], prime=97)
    with pytest.raises(ValueError, match="empty"):
        split(b"", threshold=2, holders=[1, 2])


def test_shares_of_different_splits_do_not_mix() -> None:
    a = split(b"\x01", threshold=2, holders=[1, 2], prime=97, rng=Scripted([3]))
    b = split(b"\x01\x02", threshold=2, holders=[1, 2], prime=P521, rng=Scripted([3]))
    with pytest.raises(ValueError, match="disagree"):
        combine([a[1], b[2]])


def test_points_combine_as_their_shares_do_and_are_checked_alike() -> None:
    points = [(5, HAND[5]), (2, HAND[2]), (4, HAND[4]), (1, HAND[1])]  # any order
    assert combine_points(points, threshold=3, size=1, prime=97) == bytes([42])
    with pytest.raises(ValueError, match="holder 5 does not lie"):
        combine_points([*points[1:], (5, HAND[5] + 1)], threshold=3, size=1, prime=97)
    with pytest.raises(ValueError, match="not in the field"):
        combine_points([*points[:3], (1, 97)], threshold=3, size=1, prime=97)
    with pytest.raises(ValueError, match="duplicate"):
        combine_points([*points[:3], (2, HAND[2])], threshold=3, size=1, prime=97)
    with pytest.raises(ValueError, match="2 shares given, 3 needed"):
        combine_points(points[:2], threshold=3, size=1, prime=97)
    with pytest.raises(ValueError, match="below 2"):
        combine_points(points, threshold=1, size=1, prime=97)
    with pytest.raises(ValueError, match="below 1"):
        combine_points(points, threshold=3, size=0, prime=97)
