"""Secure aggregation against a coordinator that deviates (issue 51), driven by the
adversarial-coordinator harness of tests/secagg_harness.py: each attack is a subclass of
its honest :class:`~tests.secagg_harness.Coordinator` that lies at one stage.

Each attack test asserts the property the protocol owes and failed before the fix that
stops it (an attack the protocol does not stop yet would be an ``xfail(strict=True)``
naming what would). Beside the signed fleet's tests, the same attacks on an insecure fleet
still succeed: what a fleet without the fleet CA gives up (docs/privacy.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from protocol.auth import Signer, sign
from secagg.consistency import Consistency, Signatures, Survivors
from secagg.device import SecAggDevice
from secagg.errors import Excluded, RoundAborted
from secagg.graph import holder_xs, neighbour_graph
from secagg.masks import MaskContext, pair_secret, unmask_sum
from secagg.messages import (
    SHARE_BYTES,
    Advertise,
    Close,
    MaskedInput,
    RelayedShares,
    Roster,
    SecAggMessage,
    ShareKeys,
    Stage,
    Unmask,
)
from secagg.quantise import decode, sum_error_bound
from secagg.sealing import share_of
from secagg.server import SecAggResult
from secagg.settings import SecAggSettings
from secagg.shamir import combine
from tests.fleet_ca import TestCA
from tests.secagg_harness import (
    FLEET,
    ROUND,
    RUN,
    SPEC,
    Coordinator,
    Transcript,
    clients,
    devices,
    inputs,
    puppet,
    run_round,
    settings,
    signatures_as_told,
)

N = 20
NAMES = clients(N)
COMPLETE = settings(n=N, threshold=7)
SPARSE = settings(n=N, threshold=4, neighbours=8)
GRAPHS = pytest.mark.parametrize("graph", [COMPLETE, SPARSE], ids=["complete", "sparse"])
#: What a signed fleet's devices accept: 2t > h + c for the h holders of each secret, and
#: 2T > n + c for the n devices of the roster (tests/test_secagg_quorum.py).
SIGNED = pytest.mark.parametrize(
    "graph",
    [settings(n=N, threshold=11), settings(n=N, threshold=5, neighbours=8, quorum=11)],
    ids=["complete", "sparse"],
)
VICTIM = "dev-00"
CA = TestCA()


def unmasked_alone(transcript: Transcript, vectors: Mapping[str, np.ndarray]) -> bool:
    """Whether the coordinator's result is the victim's input by itself."""
    result = transcript.result
    return result is not None and bool(
        np.allclose(result.total, vectors[VICTIM], atol=2.0 / SPEC.scale)
    )


@GRAPHS
def test_the_honest_harness_coordinator_unmasks_the_plain_sum(graph: SecAggSettings) -> None:
    vectors = inputs(NAMES)
    transcript = run_round(Coordinator(settings=graph), devices(graph, NAMES), vectors)
    assert transcript.refused == {} and transcript.aborted is None
    assert transcript.result is not None and transcript.result.survivors == tuple(NAMES)
    plain = np.sum([np.clip(v, -1.0, 1.0) for v in vectors.values()], axis=0)
    assert np.abs(transcript.result.total - plain).max() < sum_error_bound(N, spec=SPEC)


class Sybils(Coordinator):
    """Keeps one real device, ``victim``, and surrounds it with puppets of its own named
    ``names``: the real devices' ids with its keys in place of theirs, or ids it invents.
    It runs an honest round among them, so the sum it unmasks is the victim's input plus
    the puppets' zeros, whatever ``t`` is. In a signed fleet it must forge each puppet's
    advertisement (``forge``): ``unsigned``, as they come; ``rogue-ca``, signed under
    certificates of a CA of its own with the fleet CA's name; ``stolen-certificate``,
    signed with its key under a real device's certificate (the one of that id, or of
    ``dev-01`` for an invented id): certificates travel in the clear."""

    def __init__(self, *, settings: SecAggSettings, victim: str, names: Sequence[str],
                 forge: str = "unsigned") -> None:  # fmt: skip
        super().__init__(settings=settings, lax=True)
        self.victim, self.forge = victim, forge
        self.puppets = {n: puppet(n, settings, seed=900 + i) for i, n in enumerate(names)}
        self._asked: Mapping[str, Any] = {}
        self._rogue = TestCA()

    def _signed(self, advert: Advertise, real: Mapping[str, Any]) -> Advertise:
        if self.forge == "unsigned":
            return advert
        key = Ed25519PrivateKey.generate()
        if self.forge == "rogue-ca":
            certificate = self._rogue.issue(advert.client, key)
        else:
            certificate = real.get(advert.client, real["dev-01"]).certificate
        return sign(replace(advert, certificate=certificate), Signer(key), run=RUN)

    def _with_puppets(self, answers: Mapping[str, SecAggMessage], stage: str) -> dict[str, Any]:
        zero = np.zeros(self.settings.length)
        respond = {
            "advertise": lambda p, _: self._signed(p.advertise(), answers),
            "share": lambda p, m: p.share(m),
            "masked_input": lambda p, m: p.masked_input(m, zero),
            "consistency": lambda p, m: p.consistency(m),
            "unmask": lambda p, m: p.unmask(m),
        }[stage]
        if self.victim not in answers:
            # The victim left the round: there is nothing left to learn.
            raise RoundAborted(f"{self.victim} left", round=ROUND, stage=stage)
        mine = {c: respond(p, self._asked.get(c)) for c, p in self.puppets.items()}
        return {self.victim: answers[self.victim], **mine}

    def _to_victim(self, requests: Mapping[str, Any]) -> dict[str, Any]:
        self._asked = requests
        return {self.victim: requests[self.victim]}

    def rosters(self, adverts: Mapping[str, Advertise]) -> Mapping[str, Roster]:
        return self._to_victim(super().rosters(self._with_puppets(adverts, "advertise")))

    def relay(self, shares: Mapping[str, ShareKeys]) -> Mapping[str, RelayedShares]:
        return self._to_victim(super().relay(self._with_puppets(shares, "share")))

    def survivors(self, masked: Mapping[str, MaskedInput]) -> Mapping[str, Survivors]:
        return self._to_victim(super().survivors(self._with_puppets(masked, "masked_input")))

    def signatures(self, signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
        return self._to_victim(super().signatures(self._with_puppets(signed, "consistency")))

    def result(self, unmasks: Mapping[str, Unmask]) -> SecAggResult:
        return super().result(self._with_puppets(unmasks, "unmask"))


SUBSTITUTED, INVENTED = NAMES[1:], [f"ghost-{i:02d}" for i in range(1, N)]


def test_on_an_insecure_fleet_a_coordinator_playing_every_neighbour_unmasks_one_input() -> None:
    # What a fleet without the fleet CA's enrolment gives up (docs/privacy.md): the
    # coordinator's word is all a device has for its neighbours' keys.
    vectors = inputs(NAMES)
    coordinator = Sybils(settings=COMPLETE, victim=VICTIM, names=SUBSTITUTED)
    transcript = run_round(coordinator, devices(COMPLETE, NAMES), vectors)
    assert unmasked_alone(transcript, vectors)


#: Why the victim refuses each forgery of dev-01's advertisement.
WHY = {
    "unsigned": "is not relayed",
    "rogue-ca": "carries a certificate the fleet CA did not issue",
    "stolen-certificate": "is not signed by its enrolled key (bad_signature)",
}


@pytest.mark.parametrize("forge", list(WHY))
@pytest.mark.parametrize("names", [SUBSTITUTED, INVENTED], ids=["substituted", "invented"])
def test_a_coordinator_that_plays_every_neighbour_cannot_unmask_one_input(
    names: list[str], forge: str
) -> None:
    # Before issue 51's enrolment the victim took any keys the roster named, and its input
    # was unmasked alone under every forgery here (as on the insecure fleet above).
    vectors = inputs(NAMES)
    coordinator = Sybils(settings=COMPLETE, victim=VICTIM, names=names, forge=forge)
    transcript = run_round(coordinator, devices(COMPLETE, NAMES, ca=CA), vectors)
    assert not unmasked_alone(transcript, vectors), f"{VICTIM}'s input was unmasked alone"
    assert VICTIM not in transcript.answers[Stage.SHARE], "a share left the victim"
    refusal = str(transcript.refused[VICTIM])
    assert f"{VICTIM} refuses: a neighbour's advertisement " in refusal
    if names is SUBSTITUTED:
        assert refusal.endswith(f"{WHY[forge]} (dev-01)")
    elif forge == "stolen-certificate":
        assert refusal.endswith("carries a certificate issued to another device (ghost-01)")
    else:
        assert refusal.endswith(f"{WHY[forge]} (ghost-01)")


@SIGNED
def test_a_signed_fleet_of_honest_devices_unmasks_the_plain_sum(graph: SecAggSettings) -> None:
    vectors = inputs(NAMES)
    transcript = run_round(Coordinator(settings=graph), devices(graph, NAMES, ca=CA), vectors)
    assert transcript.refused == {} and transcript.result is not None
    rosters = transcript.requests[Stage.SHARE]
    assert all(isinstance(r, Roster) and set(r.adverts) == set(r.keys) - {c}
               for c, r in rosters.items())  # fmt: skip
    plain = np.sum([np.clip(v, -1.0, 1.0) for v in vectors.values()], axis=0)
    assert np.abs(transcript.result.total - plain).max() < sum_error_bound(N, spec=SPEC)


class Equivocator(Coordinator):
    """Tells ``told_dropped`` (neighbours of ``victim``) that the victim dropped, so they
    send the share of its masking key, and every other device that it survived, so they
    send the share of its self-mask seed; then rebuilds both and unmasks the victim's
    masked input alone, bypassing the server's checks."""

    def __init__(self, *, settings: SecAggSettings, victim: str, told_dropped: set[str]) -> None:
        super().__init__(settings=settings, lax=True)
        self.victim, self.told_dropped = victim, told_dropped
        self._adverts: dict[str, Advertise] = {}
        self._masked: dict[str, MaskedInput] = {}

    def rosters(self, adverts: Mapping[str, Advertise]) -> Mapping[str, Roster]:
        self._adverts = dict(adverts)
        return super().rosters(adverts)

    def survivors(self, masked: Mapping[str, MaskedInput]) -> Mapping[str, Survivors]:
        self._masked = dict(masked)
        honest = super().survivors(masked)
        without = tuple(
            c for c in honest[self.victim].listed(sorted(self._adverts)) if c != self.victim
        )
        return {
            c: replace(m, survivors=without, marks=b"") if c in self.told_dropped else m
            for c, m in honest.items()
        }

    def signatures(self, signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
        return signatures_as_told(signed)

    def result(self, unmasks: Mapping[str, Unmask]) -> SecAggResult:
        u, t = self.victim, self.settings.threshold
        index = {c: i + 1 for i, c in enumerate(sorted(self._adverts))}
        graph = neighbour_graph(sorted(self._adverts), k=self.settings.neighbours,
                                fleet=FLEET, round=ROUND)  # fmt: skip
        xs = holder_xs(u, graph[u])  # where each holder's share of u's secrets sits
        seeds = [share_of(m.seed_shares[u], x=xs[c], threshold=t)
                 for c, m in unmasks.items() if u in m.seed_shares]  # fmt: skip
        keys = [share_of(m.key_shares[u], x=xs[c], threshold=t)
                for c, m in unmasks.items() if u in m.key_shares]  # fmt: skip
        key = X25519PrivateKey.from_private_bytes(combine(keys))
        dangling = {
            (index[u], index[v]): pair_secret(
                key, X25519PublicKey.from_public_bytes(self._adverts[v].keys.s)
            )
            for v in graph[u]
        }
        alone = unmask_sum(self._masked[u].vector(), self_seeds={index[u]: combine(seeds)},
                           dangling=dangling, context=MaskContext(fleet=FLEET, round=ROUND))  # fmt: skip
        return SecAggResult(total=decode(alone, spec=self.settings.spec), survivors=(u,))

    def closes(self) -> Mapping[str, Close]:
        return {}  # its server never closed the round: it tells the devices nothing


def equivocate(graph: SecAggSettings, *, ca: TestCA | None) -> Transcript:
    # t neighbours hear the victim dropped; the victim and its other neighbours (at least
    # t of them on both graphs here) hear it survived.
    neighbours = neighbour_graph(NAMES, k=graph.neighbours, fleet=FLEET, round=ROUND)[VICTIM]
    told = set(sorted(neighbours)[: graph.threshold])
    assert len(neighbours - told) + 1 >= graph.threshold
    coordinator = Equivocator(settings=graph, victim=VICTIM, told_dropped=told)
    return run_round(coordinator, devices(graph, NAMES, ca=ca), inputs(NAMES))


@GRAPHS
def test_on_an_insecure_fleet_equivocating_survivor_lists_unmask_one_input(
    graph: SecAggSettings,
) -> None:
    # What an unsigned fleet gives up: its devices take any t (it would gain nothing to
    # refuse, since its coordinator can play every neighbour anyway).
    assert unmasked_alone(equivocate(graph, ca=None), inputs(NAMES))


@GRAPHS
def test_equivocating_survivor_lists_do_not_unmask_one_input(graph: SecAggSettings) -> None:
    # A signed device refuses, before any share leaves it, a t under which t shares of
    # its seed and t of its key can come from its h holders (c colluders give both):
    # 2t <= h + c. Before, both graphs here (t 7 of 20; t 4 of 9 holders) were taken and
    # the victim's input unmasked alone (the insecure fleet's test above).
    transcript = equivocate(graph, ca=CA)
    assert not unmasked_alone(transcript, inputs(NAMES)), f"{VICTIM}'s input was unmasked alone"
    assert transcript.answers[Stage.SHARE] == {}
    assert "survivor lists that differ could rebuild both" in str(transcript.refused[VICTIM])


@pytest.mark.parametrize(
    ("threshold", "colluding", "taken"),
    [(10, 0, False), (11, 0, True), (11, 1, True), (11, 2, False), (12, 3, True)],
)
def test_a_signed_device_takes_t_only_above_half_its_holders_and_the_colluders(
    threshold: int, colluding: int, taken: bool
) -> None:
    # The honest coordinator aborts such a round at once, saying why; one that does not
    # (lax) finds every device refusing it before any share leaves.
    graph = replace(settings(n=N, threshold=threshold), colluding=colluding)
    honest = run_round(Coordinator(settings=graph), devices(graph, NAMES, ca=CA), inputs(NAMES))
    lax = run_round(Coordinator(settings=graph, lax=True), devices(graph, NAMES, ca=CA),
                    inputs(NAMES))  # fmt: skip
    assert (honest.result is not None) is (lax.result is not None) is taken
    assert (VICTIM in lax.refused) is not taken
    if not taken:
        assert honest.aborted is not None and honest.aborted.stage == Stage.ADVERTISE.value
        assert honest.aborted.why == (
            f"t = {threshold} is not more than half of the {N} holders of a device's secrets "
            f"plus c = {colluding}: survivor lists that differ could rebuild both"
        )
        assert lax.answers[Stage.SHARE] == {}


def test_the_harness_drops_who_it_is_told_to_and_keeps_each_refusal() -> None:
    # A device that goes silent after its masked input is still in the sum; one that
    # refuses a stage leaves the round, its refusal kept.
    vectors = inputs(NAMES)
    fleet: list[SecAggDevice] = devices(COMPLETE, NAMES)

    class Stranger(Coordinator):
        def relay(self, shares: Mapping[str, ShareKeys]) -> Mapping[str, RelayedShares]:
            relayed = dict(super().relay(shares))
            honest = relayed["dev-01"]
            forged = {**honest.ciphertexts, "dev-02": bytes(len(honest.ciphertexts["dev-02"]))}
            relayed["dev-01"] = replace(honest, ciphertexts=forged)
            return relayed

    transcript = run_round(Stranger(settings=COMPLETE), fleet, vectors,
                           drop={Stage.UNMASK: {"dev-03"}})  # fmt: skip
    assert set(transcript.refused) == {"dev-01"}
    assert "do not open under the pair's key (dev-02)" in str(transcript.refused["dev-01"])
    assert transcript.result is not None
    assert "dev-03" in transcript.result.survivors and "dev-01" not in transcript.result.survivors
    assert "dev-03" not in transcript.answers[Stage.UNMASK]


def test_the_close_tells_each_device_whether_its_input_is_in_the_sum() -> None:
    # dev-03's masked input arrived but its unmask answer did not: it is in the sum, and
    # its close says so (before issue 51 it believed it was not, and added its data again
    # next round); dev-05 left before its masked input, and dev-01's input is in.
    vectors = inputs(NAMES)
    drop = {Stage.MASKED_INPUT: {"dev-05"}, Stage.UNMASK: {"dev-03"}}
    transcript = run_round(Coordinator(settings=COMPLETE), devices(COMPLETE, NAMES), vectors,
                           drop=drop)  # fmt: skip
    assert transcript.result is not None and sorted(transcript.closes) == NAMES
    summed = {c for c, close in transcript.closes.items() if close.summed}
    assert summed == set(transcript.result.survivors) == set(NAMES) - {"dev-05"}
    assert all(close.client == c for c, close in transcript.closes.items())


# Public keys of small order (secagg/points.py): refused by the device reading a roster,
# and by the coordinator taking an advertisement.

P = 2**255 - 19
#: Every small-order u-coordinate of Curve25519 and its twist (libsodium's list): u = 0
#: (the identity's encoding, and the point of order 2), 1, p - 1, the two points of
#: order 8, and the non-canonical p and p + 1; then u = 0 with the ignored top bit set.
SMALL = {
    "zero": 0,
    "one": 1,
    "p-1": P - 1,
    "order-8-a": 325606250916557431795983626356110631294008115727848805560023387167927233504,
    "order-8-b": 39382357235489614581723060781553021112529911719440698176882885853963445705823,
    "p": P,
    "p+1": P + 1,
    "zero-top-bit": 1 << 255,
}
SMALL_KEYS = pytest.mark.parametrize(
    "point", [u.to_bytes(32, "little") for u in SMALL.values()], ids=list(SMALL)
)


class WeakKey(Coordinator):
    """Hands ``victim`` a roster in which neighbour ``neighbour``'s key ``which`` (``c``
    or ``s``) is ``point``."""

    def __init__(self, *, settings: SecAggSettings, victim: str, neighbour: str, which: str,
                 point: bytes) -> None:  # fmt: skip
        super().__init__(settings=settings)
        self.victim, self.neighbour, self.which, self.point = victim, neighbour, which, point

    def rosters(self, adverts: Mapping[str, Advertise]) -> Mapping[str, Roster]:
        rosters = dict(super().rosters(adverts))
        honest = rosters[self.victim]
        weak = replace(honest.keys[self.neighbour], **{self.which: self.point})
        rosters[self.victim] = replace(honest, keys={**honest.keys, self.neighbour: weak})
        return rosters


@SMALL_KEYS
@pytest.mark.parametrize("which", ["s", "c"])
def test_a_device_refuses_a_roster_with_a_small_order_key_before_any_share_leaves(
    which: str, point: bytes
) -> None:
    # Before issue 51 a small-order masking key (s) was found only at the masked-input
    # stage, after the device had sealed the shares of its seed and masking key; an
    # encryption key (c) was refused at this point already, by the sealing's own error.
    coordinator = WeakKey(settings=COMPLETE, victim=VICTIM, neighbour="dev-07", which=which,
                          point=point)  # fmt: skip
    transcript = run_round(coordinator, devices(COMPLETE, NAMES), inputs(NAMES))
    assert VICTIM not in transcript.answers[Stage.SHARE]
    assert "a neighbour's public key is of small order (dev-07)" in str(transcript.refused[VICTIM])


class WeakDevice(SecAggDevice):
    """Advertises ``point`` in place of one of its keys."""

    point = bytes(32)

    def advertise(self) -> Advertise:
        honest = super().advertise()
        return replace(honest, keys=replace(honest.keys, s=self.point))


@SMALL_KEYS
def test_the_coordinator_excludes_an_advertisement_with_a_small_order_key(point: bytes) -> None:
    # Before issue 51 it was taken: its neighbours refused it one by one, and on the
    # complete graph every device refused, so one device aborted the round.
    fleet = devices(COMPLETE, NAMES)
    weak = WeakDevice(client="dev-03", fleet=FLEET, round=ROUND, settings=COMPLETE)
    weak.point = point
    fleet[3] = weak
    coordinator = Coordinator(settings=COMPLETE)
    vectors = inputs(NAMES)
    transcript = run_round(coordinator, fleet, vectors)
    assert isinstance(coordinator.refused["dev-03"], Excluded)
    assert coordinator.refused["dev-03"].why == "advertised a public key of small order"
    assert transcript.refused == {} and transcript.result is not None
    others = [c for c in NAMES if c != "dev-03"]
    assert transcript.result.survivors == tuple(others)
    plain = np.sum([np.clip(vectors[c], -1.0, 1.0) for c in others], axis=0)
    assert np.abs(transcript.result.total - plain).max() < sum_error_bound(N, spec=SPEC)


# Self-mask seed commitments: a wrong share among exactly t shares is found, not summed.


class LyingHolder(SecAggDevice):
    """Gives a wrong share of ``about``'s self-mask seed when it unmasks."""

    about = "dev-04"

    def unmask(self, signatures: Signatures) -> Unmask:
        honest = super().unmask(signatures)
        wrong = int.from_bytes(honest.seed_shares[self.about], "big") + 1
        shares = {**honest.seed_shares, self.about: wrong.to_bytes(SHARE_BYTES, "big")}
        return replace(honest, seed_shares=shares)


@pytest.mark.parametrize("lying", [False, True], ids=["honest", "one-wrong-share"])
def test_a_wrong_share_among_exactly_t_aborts_the_round_rather_than_spoil_the_sum(
    lying: bool,
) -> None:
    # Five devices, t = 3; two go silent after their masked inputs, so exactly three
    # shares of every seed come back. Before issue 51 a wrong one among them rebuilt a
    # wrong seed, and the round "succeeded" with a sum off by a whole self mask.
    small, names = settings(n=5, threshold=3), clients(5)
    fleet = devices(small, names)
    if lying:
        fleet[0] = LyingHolder(client="dev-00", fleet=FLEET, round=ROUND, settings=small)
    vectors = inputs(names)
    transcript = run_round(Coordinator(settings=small), fleet, vectors,
                           drop={Stage.UNMASK: {"dev-03", "dev-04"}})  # fmt: skip
    if lying:
        assert transcript.result is None and transcript.aborted is not None
        assert transcript.aborted.stage == Stage.UNMASK.value
        assert transcript.aborted.why == (
            "the rebuilt self-mask seed of dev-04 is not the one it committed to"
        )
    else:
        assert transcript.result is not None and transcript.result.survivors == tuple(names)
        plain = np.sum([np.clip(v, -1.0, 1.0) for v in vectors.values()], axis=0)
        assert np.abs(transcript.result.total - plain).max() < sum_error_bound(5, spec=SPEC)


def test_the_coordinator_excludes_an_advertisement_without_a_seed_commitment() -> None:
    fleet = devices(COMPLETE, NAMES)
    coordinator = Coordinator(settings=COMPLETE)
    with pytest.raises(Excluded, match="advertised no commitment to its self-mask seed"):
        coordinator.server.take_advertise(replace(fleet[0].advertise(), commitment=b""))
