"""Compact evidence of ``T`` signatures (secagg/evidence.py, issue 52): the draws, the
Merkle paths and the marks by hand, then real devices against coordinators that forge a
mark, open other entries than the draws call for, or bend a path. The soundness bits are
lowered in the protocol tests (to 8) so that a fleet of 40 draws fewer entries than it
has signers: the code that checks is the same."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import replace

import pytest

from protocol.errors import FieldError
from secagg import evidence
from secagg.consistency import Consistency, Signatures, Survivors, relayed
from secagg.evidence import (
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
from secagg.messages import MaskedInput, Stage
from tests.fleet_ca import TestCA
from tests.secagg_harness import Coordinator, clients, devices, inputs, run_round, settings

N = 40
NAMES = clients(N)
#: 2T > n + c with room: T 30 of 40, c 3, so f = 43 / 60.
GRAPH = replace(settings(n=N, threshold=30), colluding=3)
CA = TestCA()


def test_openings_bound_a_forgers_pass_to_two_to_the_minus_soundness_bits() -> None:
    # 10,000 devices, T 9,000, c 900: f = 10,900 / 18,000, -log2 f = 0.7237: 176.9 -> 177.
    assert openings(devices=10_000, colluding=900, quorum=9_000) == 177
    m = openings(devices=10_000, colluding=900, quorum=9_000)
    assert (10_900 / 18_000) ** m <= 2.0**-128 < (10_900 / 18_000) ** (m - 1)
    with pytest.raises(ValueError, match="not above half"):
        openings(devices=100, colluding=10, quorum=55)  # 2T = 110 = n + c


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13, 17])
def test_any_set_of_leaves_leads_to_the_root_and_nothing_else_does(count: int) -> None:
    leaves = [leaf(bytes([i])) for i in range(count)]
    tree = levels(leaves)
    root = tree[-1][0]
    depth = math.ceil(math.log2(max(count, 2)))
    for opened in ({0}, {count - 1}, set(range(0, count, 3)), set(range(count))):
        proof = multipath(tree, opened)
        given = {i: leaves[i] for i in opened}
        assert len(proof) % 32 == 0 and len(proof) <= 32 * depth * len(opened)
        assert multiroot(given, count=count, proof=proof) == root
        assert multiroot({**given, min(opened): leaf(b"other")}, count=count, proof=proof) != root
        if proof:
            bent = bytes([proof[0] ^ 1]) + proof[1:]
            assert multiroot(given, count=count, proof=bent) != root
            assert multiroot(given, count=count, proof=proof[:-32]) is None
        assert multiroot(given, count=count, proof=proof + bytes(32)) is None
    # Every leaf opened needs no node at all; one index out of range leads nowhere.
    assert multipath(tree, range(count)) == b""
    assert multiroot({count: leaves[0]}, count=count, proof=b"") is None


def test_two_leaves_and_three_by_hand() -> None:
    a, b = leaf(b"a"), leaf(b"b")
    assert a == hashlib.sha256(b"\x00a").digest()
    assert levels([a, b])[-1][0] == hashlib.sha256(b"\x01" + a + b).digest()
    # An odd last node goes up unpaired: three leaves hash (ab) with c.
    c = leaf(b"c")
    ab = hashlib.sha256(b"\x01" + a + b).digest()
    assert levels([a, b, c])[-1][0] == hashlib.sha256(b"\x01" + ab + c).digest()
    assert multipath(levels([a, b, c]), [2]) == ab
    # Opening a and c: b's leaf is the one node sent; c climbs unpaired to meet (ab).
    assert multipath(levels([a, b, c]), [0, 2]) == b


def test_marks_round_trip_and_refuse_a_bitmap_that_does_not_fit() -> None:
    listed = clients(11)
    signers = {"dev-00": 1, "dev-03": 1, "dev-10": 1}
    marks = marks_of(listed, signers)
    assert marks == bytes([0b00001001, 0b00000100])
    assert marked(listed, marks) == ["dev-00", "dev-03", "dev-10"]
    with pytest.raises(FieldError, match="expected 2 bytes"):
        marked(listed, marks + b"\x00")
    with pytest.raises(FieldError, match="past the list"):
        marked(listed, bytes([0, 0b00001000]))  # bit 11 of an 11-long list


def test_draws_are_the_commitments_and_the_recipients() -> None:
    commit = commitment(b"l" * 32, b"\x01", b"r" * 32)
    a = positions(commit, client="dev-01", count=1000, draws=50)
    assert a == positions(commit, client="dev-01", count=1000, draws=50)
    assert a != positions(commit, client="dev-02", count=1000, draws=50)
    assert a != positions(commitment(b"l" * 32, b"\x01", b"s" * 32), client="dev-01",
                          count=1000, draws=50)  # fmt: skip
    assert all(0 <= p < 1000 for p in a) and a == sorted(set(a)) and 45 <= len(a) <= 50


def test_compact_pays_only_where_the_draws_are_far_fewer_than_the_signers() -> None:
    assert not compact_pays(signers=90, draws=177, entry_bytes=400)
    assert compact_pays(signers=9_000, draws=177, entry_bytes=400)


def _evidence_sent(requests: Mapping[str, object]) -> list[Signatures]:
    return [m for m in requests.values() if isinstance(m, Signatures)]


@pytest.fixture
def eight_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evidence, "SOUNDNESS_BITS", 8)


@pytest.mark.usefixtures("eight_bits")
def test_an_honest_signed_round_sends_compact_evidence_and_finishes() -> None:
    assert openings(devices=N, colluding=3, quorum=30) == 17
    transcript = run_round(Coordinator(settings=GRAPH), devices(GRAPH, NAMES, ca=CA),
                           inputs(NAMES), drop={Stage.CONSISTENCY: {"dev-39"}})  # fmt: skip
    assert transcript.refused == {} and transcript.result is not None
    sent = _evidence_sent(transcript.requests[Stage.UNMASK])
    assert len(sent) == N - 1
    assert all(m.marks and len(m.signed) <= 17 for m in sent)
    # dev-39 dropped before signing: unmarked, never opened, its input still in the sum.
    assert all("dev-39" not in marked(NAMES, m.marks) for m in sent)
    assert "dev-39" in transcript.result.survivors


class Compact(Coordinator):
    """Honest up to the signatures, then sends compact evidence bent as ``how`` says."""

    def __init__(self, *, how: str) -> None:
        super().__init__(settings=GRAPH)
        self.how = how

    def signatures(self, signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
        self.take(self.server.take_consistency, signed)
        self.server.close_consistency()  # its own server moves on to the unmasking
        payload = {c: m.to_wire() for c, m in signed.items()}
        if self.how == "forged-marks":
            # 10 real signers, 30 marked who never signed this list: their leaves hash
            # bytes the coordinator made up. 17 draws all miss them 1 time in 10^10.
            real = {c: payload[c] for c in NAMES[:10]}
            payload = real | {c: b"made up " + c.encode() for c in NAMES[10:]}
        honest = relayed(fleet=signed[NAMES[0]].fleet, round=signed[NAMES[0]].round,
                         survivors=tuple(NAMES), signed=payload, certificates={},
                         graph={c: frozenset(NAMES) - {c} for c in NAMES},
                         settings=GRAPH, devices=N)  # fmt: skip
        if self.how == "other-openings":
            return {c: replace(m, signed={v: payload[v] for v in NAMES[:17]})
                    for c, m in honest.items()}  # fmt: skip
        if self.how == "bent-path":
            return {c: replace(m, proof=bytes(len(m.proof))) for c, m in honest.items()}
        if self.how == "few-marks":
            few = marks_of(NAMES, dict.fromkeys(NAMES[:29]))
            return {c: replace(m, marks=few) for c, m in honest.items()}
        return honest


REFUSALS = {
    "forged-marks": "signed list does not decode",
    "other-openings": "not those its draws call for",
    "bent-path": "not under the committed root",
    "few-marks": "29 survivors marked",
}


@pytest.mark.usefixtures("eight_bits")
@pytest.mark.parametrize("how", sorted(REFUSALS))
def test_a_device_releases_no_share_on_compact_evidence_that_does_not_hold(how: str) -> None:
    transcript = run_round(Compact(how=how), devices(GRAPH, NAMES, ca=CA), inputs(NAMES))
    assert transcript.answers.get(Stage.UNMASK, {}) == {}
    assert set(transcript.refused) == set(NAMES)
    assert all(REFUSALS[how] in str(r) for r in transcript.refused.values())


def test_the_survivor_list_goes_as_marks_over_the_roster_and_must_fit_it() -> None:
    transcript = run_round(Coordinator(settings=GRAPH), devices(GRAPH, NAMES),
                           inputs(NAMES), drop={Stage.MASKED_INPUT: {"dev-07"}})  # fmt: skip
    sent = transcript.requests[Stage.CONSISTENCY]
    assert all(isinstance(m, Survivors) and m.survivors == () and len(m.marks) == 5
               for m in sent.values())  # fmt: skip
    listed = next(iter(sent.values())).listed(NAMES)  # type: ignore[attr-defined]
    assert listed == tuple(c for c in NAMES if c != "dev-07")
    assert transcript.result is not None and transcript.refused == {}
    # Marks one byte short of the roster: refused before anything is signed.
    fleet = devices(GRAPH, NAMES)
    short = run_round(ShortMarks(settings=GRAPH), fleet, inputs(NAMES))
    assert short.answers.get(Stage.CONSISTENCY, {}) == {}
    assert all("survivor marks do not fit the roster" in str(r) for r in short.refused.values())


class ShortMarks(Coordinator):
    def survivors(self, masked: Mapping[str, MaskedInput]) -> Mapping[str, Survivors]:
        return {c: replace(m, marks=m.marks[:-1]) for c, m in super().survivors(masked).items()}
