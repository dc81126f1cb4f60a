"""The fleet's quorum ``T`` (issues 51 and 52): on a sparse graph (SecAgg+) ``t`` is a
neighbourhood's threshold, and ``T`` the fewest survivors the whole round may finish with,
the signatures on one survivor list a device wants before any share leaves it, and what
the noise is calibrated to (each device adds ``sigma^2 / T``).

The attack it stops: a coordinator that tells each device a survivor list of its own
making can unmask one input on a sparse graph without ever asking one device for both of
another's secrets, so ``2t > h + c`` does not stop it (docs/privacy.md, "Equivocation
across devices"). It shows the victim and a few of its neighbours a list where all of them
survived (they send shares of the victim's self-mask seed), and everyone else a list
where those neighbours dropped (they send shares of each neighbour's masking key, which
give the victim's pair masks). Both lists gather ``t`` signatures when ``t`` is a
neighbourhood's; with ``2T > n + c`` no two lists gather ``T``."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from secagg.consistency import Consistency, Signatures, Survivors
from secagg.errors import RoundAborted
from secagg.fleet import SecureAggregation, secure_release
from secagg.graph import holder_xs, neighbour_graph
from secagg.masks import MaskContext, pair_secret, unmask_sum
from secagg.messages import (
    Advertise,
    Close,
    MaskedInput,
    RelayedShares,
    Roster,
    ShareKeys,
    Stage,
    Unmask,
)
from secagg.quantise import decode
from secagg.sealing import share_of
from secagg.server import SecAggResult
from secagg.settings import SecAggSettings
from secagg.shamir import combine
from tests.fleet_ca import TestCA
from tests.secagg_harness import (
    FLEET,
    ROUND,
    Coordinator,
    Transcript,
    clients,
    devices,
    inputs,
    run_round,
    settings,
    signatures_as_told,
)

N = 20
NAMES = clients(N)
VICTIM = "dev-00"
CA = TestCA()
#: A neighbourhood's threshold a signed device takes on this graph: 2t > h + c, h = 9.
SPARSE = settings(n=N, threshold=5, neighbours=8)


def accomplices(graph: SecAggSettings) -> set[str]:
    """``t - 1`` of the victim's neighbours, each with at least ``t`` neighbours outside
    them and the victim (who can be told it dropped)."""
    g = neighbour_graph(NAMES, k=graph.neighbours, fleet=FLEET, round=ROUND)
    t = graph.threshold
    for chosen in itertools.combinations(sorted(g[VICTIM]), t - 1):
        inner = set(chosen) | {VICTIM}
        if all(len(g[w] - inner) >= t for w in chosen):
            return set(chosen)
    raise AssertionError("no such neighbours on this graph")


class CrossEquivocator(Coordinator):
    """Unmasks the victim's input alone on a sparse graph by equivocating across devices.

    The victim masks with its accomplices only (it is relayed their shares alone, as if
    its other neighbours had dropped before the masked inputs); the victim and the
    accomplices are told that they survived and the victim's other neighbours did not,
    everyone else that the accomplices dropped.
    The first list gives ``t`` shares of the victim's seed, the second ``t`` shares of
    each accomplice's masking key."""

    def __init__(self, *, settings: SecAggSettings) -> None:
        super().__init__(settings=settings, lax=True)
        self.inner = accomplices(settings) | {VICTIM}
        self._adverts: dict[str, Advertise] = {}
        self._masked: dict[str, MaskedInput] = {}

    def rosters(self, adverts: Mapping[str, Advertise]) -> Mapping[str, Roster]:
        self._adverts = dict(adverts)
        return super().rosters(adverts)

    def relay(self, shares: Mapping[str, ShareKeys]) -> Mapping[str, RelayedShares]:
        honest = dict(super().relay(shares))
        mine = honest[VICTIM]
        honest[VICTIM] = replace(mine, ciphertexts={
            v: c for v, c in mine.ciphertexts.items() if v in self.inner
        })  # fmt: skip
        return honest

    def survivors(self, masked: Mapping[str, MaskedInput]) -> Mapping[str, Survivors]:
        self._masked = dict(masked)
        g = neighbour_graph(NAMES, k=self.settings.neighbours, fleet=FLEET, round=ROUND)
        # The victim's other neighbours dropped as far as the inner list says (it never
        # got their shares); the accomplices as far as the outer one says.
        inner = tuple(c for c in sorted(masked) if c not in g[VICTIM] - self.inner)
        outer = tuple(c for c in sorted(masked) if c not in self.inner - {VICTIM})
        return {
            c: Survivors(fleet=FLEET, round=ROUND, client=c,
                         survivors=inner if c in self.inner else outer)
            for c in masked
        }  # fmt: skip

    def signatures(self, signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
        return signatures_as_told(signed)

    def result(self, unmasks: Mapping[str, Unmask]) -> SecAggResult:
        t = self.settings.threshold
        index = {c: i + 1 for i, c in enumerate(sorted(self._adverts))}
        g = neighbour_graph(NAMES, k=self.settings.neighbours, fleet=FLEET, round=ROUND)

        def rebuilt(owner: str, kind: str) -> bytes:
            given = [(c, getattr(m, kind)[owner]) for c, m in unmasks.items()
                     if owner in getattr(m, kind)]  # fmt: skip
            xs = holder_xs(owner, g[owner])  # where each holder's share sits
            try:
                return combine([share_of(v, x=xs[c], threshold=t) for c, v in given])
            except ValueError as exc:  # too few shares came back: the attack failed
                raise RoundAborted(str(exc), round=ROUND, stage=Stage.UNMASK.value) from exc

        victim_s = X25519PublicKey.from_public_bytes(self._adverts[VICTIM].keys.s)
        dangling = {
            (index[VICTIM], index[w]): pair_secret(
                X25519PrivateKey.from_private_bytes(rebuilt(w, "key_shares")), victim_s
            )
            for w in sorted(self.inner - {VICTIM})
        }
        alone = unmask_sum(
            self._masked[VICTIM].vector(), self_seeds={index[VICTIM]: rebuilt(VICTIM, "seed_shares")},
            dangling=dangling, context=MaskContext(fleet=FLEET, round=ROUND),
        )  # fmt: skip
        return SecAggResult(total=decode(alone, spec=self.settings.spec), survivors=(VICTIM,))

    def closes(self) -> Mapping[str, Close]:
        return {}


def cross_equivocate(graph: SecAggSettings, *, ca: TestCA | None) -> Transcript:
    return run_round(CrossEquivocator(settings=graph), devices(graph, NAMES, ca=ca), inputs(NAMES))


def unmasked_alone(transcript: Transcript) -> bool:
    result, vector = transcript.result, inputs(NAMES)[VICTIM]
    return result is not None and bool(
        np.abs(result.total - np.clip(vector, -1.0, 1.0)).max() < 1e-3
    )


def test_the_attack_is_real_where_devices_take_a_neighbourhoods_t_as_the_quorum() -> None:
    # An insecure fleet takes any t; before the quorum, so did a signed one on this graph
    # (2t = 10 > h + c = 9), and the victim's input was unmasked alone.
    transcript = cross_equivocate(SPARSE, ca=None)
    assert transcript.refused == {}
    assert unmasked_alone(transcript)


def test_a_signed_device_refuses_a_quorum_two_lists_could_each_gather() -> None:
    transcript = cross_equivocate(SPARSE, ca=CA)
    assert not unmasked_alone(transcript)
    assert transcript.answers[Stage.SHARE] == {}  # no share left any device
    assert str(transcript.refused[VICTIM]).endswith(
        "T = 5 is not more than half of the 20 devices in the roster plus c = 0: two "
        "survivor lists could each gather T signatures"
    )


def test_with_a_quorum_above_half_the_roster_the_attack_gets_no_seed_share() -> None:
    graph = replace(SPARSE, quorum=11)
    transcript = cross_equivocate(graph, ca=CA)
    assert not unmasked_alone(transcript)
    inner = accomplices(graph) | {VICTIM}
    # The victim and its accomplices see t signatures on their list but not T: none of
    # them releases a share of anything.
    assert set(transcript.answers[Stage.UNMASK]).isdisjoint(inner)
    assert "5 survivors signed its survivor list, fewer than T = 11" in str(
        transcript.refused[VICTIM]
    )


class Withholder(Coordinator):
    """Relays each device one signed list fewer than it holds."""

    def signatures(self, signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
        honest = super().signatures(signed)
        return {c: replace(m, signed=dict(list(m.signed.items())[1:])) for c, m in honest.items()}


@pytest.mark.parametrize(("survivors", "released"), [(15, True), (14, False)])
def test_a_device_releases_shares_only_on_evidence_of_t_survivors(
    survivors: int, released: bool
) -> None:
    graph = replace(SPARSE, quorum=14)
    gone = {Stage.MASKED_INPUT: set(NAMES[survivors:])}
    transcript = run_round(Withholder(settings=graph), devices(graph, NAMES, ca=CA),
                           inputs(NAMES), drop=gone)  # fmt: skip
    # Every survivor signs; each is shown one signature fewer than there are: 14 of 15
    # are still T, 13 of 14 are not.
    assert len(transcript.answers[Stage.CONSISTENCY]) == survivors
    assert bool(transcript.answers[Stage.UNMASK]) is released
    if not released:
        assert all("13 survivors signed its survivor list, fewer than T = 14" in str(r)
                   for r in transcript.refused.values())  # fmt: skip


def test_the_quorum_is_the_fewest_survivors_and_never_below_t() -> None:
    assert SPARSE.fewest == 5 and replace(SPARSE, quorum=12).fewest == 12
    with pytest.raises(ValueError, match=r"quorum 4 must be 0 \(the threshold\) or at least"):
        replace(SPARSE, quorum=4)
    table = SecureAggregation(threshold=5, neighbours=8, quorum=3, dataset_size=20)
    assert table.problem() == (
        "[secure_aggregation] quorum = 3 is below threshold = 5: a round cannot finish "
        "with fewer devices than t"
    )


def test_the_quorum_calibrates_the_noise_of_a_sparse_graph_as_the_complete_graphs_t() -> None:
    # Each device adds sigma^2 / T, and the plan counts T - c honest shares: a SecAgg+ round
    # with quorum 900 is planned as the complete graph with t = 900, not with its t of 40.
    sparse = SecureAggregation(threshold=40, neighbours=60, quorum=900, colluding=10,
                               dataset_size=20, epsilon=1.0)  # fmt: skip
    complete = SecureAggregation(threshold=900, colluding=10, dataset_size=20, epsilon=1.0)
    without = replace(sparse, quorum=0)
    plans = [secure_release(t, k=8, classes=3, gram=True).plan for t in (sparse, complete, without)]
    assert plans[0] is not None and plans[1] is not None and plans[2] is not None
    assert plans[0].sigma2 == plans[1].sigma2
    assert plans[0].share_sigma2 == plans[1].share_sigma2 == plans[0].sigma2 / 900
    # Without the quorum the noise of the 1,000-device sum is that of 40 shares' worth each.
    assert plans[2].sum_std(1000) > 4 * plans[0].sum_std(1000)
    assert secure_release(sparse, k=8, classes=3, gram=True).settings.fewest == 900
