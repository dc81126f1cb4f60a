"""A whole secure-aggregation round in memory: 20 devices and the coordinator's state
machine, every message through its wire encoding. The unmasked sum equals the plain sum
within the quantisation bound, with a third of the devices dropping after each stage; too
few survivors abort the round with the reason; and each party refuses what it must."""

from collections.abc import Mapping, Sequence
from dataclasses import replace
from fractions import Fraction
from random import Random
from typing import TypeVar

import numpy as np
import pytest

from secagg.consistency import Signatures, Survivors
from secagg.device import SecAggDevice
from secagg.errors import Refused, RoundAborted
from secagg.graph import neighbour_graph
from secagg.messages import (
    Abort,
    MaskedInput,
    PublicKeys,
    SecAggMessage,
    ShareKeys,
    Stage,
)
from secagg.quantise import QuantiseSpec, sum_error_bound
from secagg.server import SecAggResult, SecAggServer
from secagg.settings import SecAggSettings

M = TypeVar("M", bound=SecAggMessage)
N = 20
LENGTH = 6
SPEC = QuantiseSpec(clip=1.0, scale=2.0**16, bits=32)
COMPLETE = SecAggSettings(threshold=7, neighbours=N - 1, spec=SPEC, length=LENGTH)
SPARSE = SecAggSettings(threshold=4, neighbours=8, spec=SPEC, length=LENGTH)
CLIENTS = [f"dev-{i:02d}" for i in range(N)]
#: A third of the fleet: every third device, which the seeded shuffle scatters over the graph.
THIRD = set(CLIENTS[::3])


def wire(message: M) -> M:
    """``message`` as the other side decodes it."""
    return type(message).from_wire(message.to_wire())


def inputs(seed: int = 1) -> dict[str, np.ndarray]:
    rows = np.random.default_rng(seed).uniform(-1.0, 1.0, size=(N, LENGTH))
    return dict(zip(CLIENTS, rows, strict=True))


def devices(settings: SecAggSettings, clients: Sequence[str] = CLIENTS) -> list[SecAggDevice]:
    return [
        SecAggDevice(client=c, fleet="lab", round=5, settings=settings, rng=Random(100 + i))
        for i, c in enumerate(clients)
    ]


def run_round(
    settings: SecAggSettings,
    vectors: Mapping[str, np.ndarray],
    *,
    drop: Mapping[Stage, set[str]] | None = None,
    server: SecAggServer | None = None,
) -> SecAggResult:
    """One round; ``drop[stage]`` go silent at ``stage`` (and stay gone)."""
    gone = drop or {}
    server = server or SecAggServer(fleet="lab", round=5, settings=settings)
    alive = devices(settings)
    for d in alive:
        server.take_advertise(wire(d.advertise()))
    rosters = server.close_advertise()
    alive = [d for d in alive if d.client not in gone.get(Stage.SHARE, set())]
    for d in alive:
        server.take_share(wire(d.share(wire(rosters[d.client]))))
    relayed = server.close_share()
    alive = [d for d in alive if d.client not in gone.get(Stage.MASKED_INPUT, set())]
    for d in alive:
        message = d.masked_input(wire(relayed[d.client]), vectors[d.client])
        server.take_masked_input(wire(message))
    survivors = server.close_masked_input()
    alive = [d for d in alive if d.client not in gone.get(Stage.CONSISTENCY, set())]
    for d in alive:
        server.take_consistency(wire(d.consistency(wire(survivors[d.client]))))
    signatures = server.close_consistency()
    alive = [d for d in alive if d.client not in gone.get(Stage.UNMASK, set())]
    for d in alive:
        server.take_unmask(wire(d.unmask(wire(signatures[d.client]))))
    return server.close_unmask()


def plain_sum(vectors: Mapping[str, np.ndarray], clients: Sequence[str]) -> np.ndarray:
    return np.sum([np.clip(vectors[c], -SPEC.clip, SPEC.clip) for c in clients], axis=0)


@pytest.mark.parametrize("settings", [COMPLETE, SPARSE], ids=["complete", "sparse"])
def test_the_unmasked_sum_is_the_plain_sum_within_the_quantisation_bound(
    settings: SecAggSettings,
) -> None:
    vectors = inputs()
    result = run_round(settings, vectors)
    assert result.survivors == tuple(CLIENTS)
    error = np.abs(result.total - plain_sum(vectors, CLIENTS))
    assert error.max() < sum_error_bound(N, spec=SPEC)
    # The rounding really happened: the sum is not exact, only within the bound.
    assert error.max() > 0


@pytest.mark.parametrize("settings", [COMPLETE, SPARSE], ids=["complete", "sparse"])
@pytest.mark.parametrize("stage", [Stage.SHARE, Stage.MASKED_INPUT, Stage.UNMASK])
def test_a_third_dropping_at_one_stage_still_recovers_the_survivors_sum(
    settings: SecAggSettings, stage: Stage
) -> None:
    vectors = inputs()
    result = run_round(settings, vectors, drop={stage: THIRD})
    # Whoever dropped before sending a masked input is not in the sum; after, still is.
    counted = CLIENTS if stage is Stage.UNMASK else sorted(set(CLIENTS) - THIRD)
    assert result.survivors == tuple(counted)
    assert result.dropped[stage] == tuple(sorted(THIRD))
    error = np.abs(result.total - plain_sum(vectors, counted))
    assert error.max() < sum_error_bound(len(counted), spec=SPEC)


def test_a_third_dropping_at_every_stage_in_turn_still_recovers() -> None:
    settings = replace(COMPLETE, threshold=5)
    # 20 advertise; 7 drop (13 share); 5 of those drop (8 mask); 3 of those drop (5 unmask).
    rest = [c for c in CLIENTS if c not in THIRD]
    counted = [c for c in rest if c not in rest[::3]]
    drop = {Stage.SHARE: THIRD, Stage.MASKED_INPUT: set(rest[::3]), Stage.CONSISTENCY: set(),
            Stage.UNMASK: set(counted[::3])}  # fmt: skip
    vectors = inputs(2)
    result = run_round(settings, vectors, drop=drop)
    assert result.survivors == tuple(counted)
    assert result.dropped == {stage: tuple(sorted(ids)) for stage, ids in drop.items()}
    error = np.abs(result.total - plain_sum(vectors, counted))
    assert error.max() < sum_error_bound(len(counted), spec=SPEC)


def test_distributed_noise_is_added_in_whole_units_and_stays_within_its_tails() -> None:
    vectors = inputs()
    plain = run_round(SPARSE, vectors)
    noisy = run_round(replace(SPARSE, sigma2=Fraction(400)), vectors)
    # The same seeds draw the same rounding coins before the noise, so the difference is
    # the summed noise alone: 20 draws of N_Z(0, 400 / 4), standard deviation ~ 45 units.
    units = (noisy.total - plain.total) * SPEC.scale
    assert np.array_equal(units, np.round(units))
    assert np.count_nonzero(units) > 0
    assert np.abs(units).max() < 6 * np.sqrt(N * 400 / SPARSE.threshold)


@pytest.mark.parametrize(
    ("stage", "gone", "reason"),
    [
        (Stage.SHARE, 14, "6 devices shared keys, fewer than the threshold t = 7"),
        (Stage.MASKED_INPUT, 14, "6 devices sent masked inputs, fewer than the threshold t = 7"),
        (Stage.UNMASK, 14, "6 devices sent their shares, fewer than the threshold t = 7"),
    ],
)
def test_fewer_than_t_survivors_abort_the_round_and_say_why(
    stage: Stage, gone: int, reason: str
) -> None:
    server = SecAggServer(fleet="lab", round=5, settings=COMPLETE)
    with pytest.raises(RoundAborted, match=reason) as caught:
        run_round(COMPLETE, inputs(), drop={stage: set(CLIENTS[:gone])}, server=server)
    assert caught.value.stage == stage.value
    notices = server.abort_messages()
    assert sorted(notices) == CLIENTS
    notice = wire(notices["dev-03"])
    assert isinstance(notice, Abort)
    assert (notice.stage, notice.reason) == (stage, reason)
    with pytest.raises(RoundAborted):
        server.close_unmask()


def test_too_few_devices_advertising_abort_at_once() -> None:
    server = SecAggServer(fleet="lab", round=5, settings=COMPLETE)
    for d in devices(COMPLETE, CLIENTS[:6]):
        server.take_advertise(d.advertise())
    with pytest.raises(RoundAborted, match="6 devices advertised keys, fewer than"):
        server.close_advertise()


def test_too_few_shares_of_one_seed_abort_naming_the_device() -> None:
    # dev-00 keeps one neighbour: its seed has 2 shares left (its own and that one's).
    graph = neighbour_graph(CLIENTS, k=SPARSE.neighbours, fleet="lab", round=5)
    keep = sorted(graph["dev-00"])[0]
    gone = set(graph["dev-00"]) - {keep}
    with pytest.raises(RoundAborted, match="2 shares of the self-mask seed of dev-00 came back"):
        run_round(SPARSE, inputs(), drop={Stage.UNMASK: gone})


def test_an_overflowing_fleet_aborts_before_any_share() -> None:
    tight = SecAggSettings(
        threshold=2, neighbours=3, spec=QuantiseSpec(clip=1.0, scale=2.0**29, bits=32), length=2
    )
    server = SecAggServer(fleet="lab", round=5, settings=tight)
    for d in devices(tight, CLIENTS[:5]):
        server.take_advertise(d.advertise())
    with pytest.raises(RoundAborted, match="overflow the 32-bit ring"):
        server.close_advertise()


# The device's refusals.


def staged(settings: SecAggSettings = COMPLETE) -> tuple[list[SecAggDevice], SecAggServer]:
    """Devices and a server through the advertise stage."""
    fleet = devices(settings)
    server = SecAggServer(fleet="lab", round=5, settings=settings)
    for d in fleet:
        server.take_advertise(d.advertise())
    return fleet, server


def through_masked_input(
    settings: SecAggSettings = COMPLETE,
) -> tuple[list[SecAggDevice], SecAggServer, dict[str, Survivors]]:
    """Devices and a server with every masked input in, the unmask stage open."""
    fleet, server = staged(settings)
    rosters = server.close_advertise()
    for d in fleet:
        server.take_share(d.share(rosters[d.client]))
    relayed = server.close_share()
    vectors = inputs()
    for d in fleet:
        server.take_masked_input(d.masked_input(relayed[d.client], vectors[d.client]))
    return fleet, server, server.close_masked_input()


def signed_off(
    fleet: list[SecAggDevice], server: SecAggServer, survivors: Mapping[str, Survivors]
) -> dict[str, Signatures]:
    """Every device signs the list it was sent; what the coordinator relays."""
    for d in fleet:
        server.take_consistency(d.consistency(survivors[d.client]))
    return server.close_consistency()


def test_a_device_asked_for_both_shares_of_a_neighbour_refuses() -> None:
    fleet, server, survivors = through_masked_input()
    signatures = signed_off(fleet, server, survivors)
    device = fleet[0]
    first = device.unmask(signatures[device.client])
    assert "dev-01" in first.seed_shares
    # The same request again (a redelivery) gets the same answer...
    assert device.unmask(signatures[device.client]) == first
    # ...but a coordinator now claiming dev-01 dropped asks for its key share as well.
    claim = replace(survivors[device.client], survivors=tuple(set(CLIENTS) - {"dev-01"}), marks=b"")
    with pytest.raises(Refused, match=r"both shares of a device \(dev-01\)"):
        device.consistency(claim)


def test_shares_that_disagree_abort_the_round_naming_the_device() -> None:
    fleet, server, survivors = through_masked_input()
    signatures = signed_off(fleet, server, survivors)
    answers = [d.unmask(signatures[d.client]) for d in fleet]
    # One holder lies about its share of dev-05's seed: 20 shares, t = 7, so the extra
    # shares no longer lie on the polynomial of the first seven.
    liar = answers[-1]
    forged = {**liar.seed_shares, "dev-05": bytes(65) + b"\x01"}
    answers[-1] = replace(liar, seed_shares=forged)
    for answer in answers:
        server.take_unmask(answer)
    with pytest.raises(RoundAborted, match="shares of the self-mask seed of dev-05 disagree"):
        server.close_unmask()


def test_a_device_refuses_to_unmask_with_fewer_than_t_survivors() -> None:
    fleet, server = staged()
    rosters = server.close_advertise()
    for d in fleet:
        server.take_share(d.share(rosters[d.client]))
    relayed = server.close_share()
    device = fleet[0]
    device.masked_input(relayed[device.client], inputs()[device.client])
    few = Survivors(fleet="lab", round=5, client=device.client, survivors=tuple(CLIENTS[:6]))
    with pytest.raises(Refused, match="6 survivors, fewer than t = 7"):
        device.consistency(few)


def test_a_device_refuses_a_roster_without_its_keys_or_with_another_graph() -> None:
    fleet, server = staged(SPARSE)
    rosters = server.close_advertise()
    device = fleet[0]
    roster = rosters[device.client]
    stolen = PublicKeys(c=bytes(range(32)), s=bytes(range(1, 33)))
    with pytest.raises(Refused, match="does not carry this device's keys"):
        device.share(replace(roster, keys={**roster.keys, device.client: stolen}))
    stranger = next(c for c in CLIENTS if c not in roster.keys)
    extra = {**roster.keys, stranger: rosters[stranger].keys[stranger]}
    with pytest.raises(Refused, match="not those of the public graph"):
        device.share(replace(roster, keys=extra))
    elsewhere = replace(roster, round=6)
    with pytest.raises(Refused, match="round 6"):
        device.share(elsewhere)
    # None of the refusals used up the stage: the honest roster is still answered.
    assert isinstance(device.share(roster), ShareKeys)


def test_a_device_refuses_a_neighbour_key_seen_twice() -> None:
    fleet, server = staged(SPARSE)
    roster = server.close_advertise()[fleet[0].client]
    neighbour = next(c for c in roster.keys if c != fleet[0].client)
    copied = PublicKeys(c=roster.keys[fleet[0].client].c, s=bytes(range(32)))
    with pytest.raises(Refused, match="one public key twice"):
        fleet[0].share(replace(roster, keys={**roster.keys, neighbour: copied}))


def test_a_device_refuses_tampered_or_redirected_ciphertexts() -> None:
    fleet, server = staged(SPARSE)
    rosters = server.close_advertise()
    shares = {d.client: d.share(rosters[d.client]) for d in fleet}
    for message in shares.values():
        server.take_share(message)
    relayed = server.close_share()
    device = fleet[0]
    honest = relayed[device.client]
    sender, ct = next(iter(honest.ciphertexts.items()))
    flipped = bytes([ct[0] ^ 1]) + ct[1:]
    vector = inputs()[device.client]
    with pytest.raises(Refused, match=f"do not open.*{sender}"):
        device.masked_input(
            replace(honest, ciphertexts={**honest.ciphertexts, sender: flipped}), vector
        )
    # sender's ciphertext for another of its neighbours, relayed to this device instead.
    other = next(v for v in shares[sender].ciphertexts if v != device.client)
    moved = {**honest.ciphertexts, sender: shares[sender].ciphertexts[other]}
    with pytest.raises(Refused, match="do not open"):
        device.masked_input(replace(honest, ciphertexts=moved), vector)
    stranger = next(c for c in CLIENTS if c not in rosters[device.client].keys)
    with pytest.raises(Refused, match="not a neighbour"):
        device.masked_input(
            replace(honest, ciphertexts={**honest.ciphertexts, stranger: ct}), vector
        )
    assert isinstance(device.masked_input(honest, vector), MaskedInput)


def test_a_device_refuses_stages_out_of_order() -> None:
    fleet, server = staged()
    rosters = server.close_advertise()
    fresh = devices(COMPLETE)[0]
    with pytest.raises(Refused, match="before the previous one ended"):
        fresh.share(rosters[fresh.client])
    survivors = Survivors(fleet="lab", round=5, client=fleet[0].client, survivors=tuple(CLIENTS))
    with pytest.raises(Refused, match="before the previous one ended"):
        fleet[0].consistency(survivors)


# The coordinator's refusals.


def test_the_coordinator_refuses_messages_it_must_not_act_on() -> None:
    fleet, server = staged(SPARSE)
    rosters = server.close_advertise()
    device = fleet[0]
    message = device.share(rosters[device.client])
    partial = replace(message, ciphertexts=dict(list(message.ciphertexts.items())[1:]))
    with pytest.raises(Refused, match="exactly its neighbours"):
        server.take_share(partial)
    server.take_share(message)
    server.take_share(message)  # a redelivery is harmless
    with pytest.raises(Refused, match="second, different"):
        server.take_share(partial)
    stranger = devices(SPARSE, ["dev-99"])[0]
    with pytest.raises(Refused, match="not in the round"):
        server.take_share(ShareKeys(fleet="lab", round=5, client="dev-99", ciphertexts={}))
    with pytest.raises(Refused, match="not at advertise"):
        server.take_advertise(stranger.advertise())
    for d in fleet[1:]:
        server.take_share(d.share(rosters[d.client]))
    relayed = server.close_share()
    short = MaskedInput(fleet="lab", round=5, client=device.client, bits=32, masked=bytes(8))
    with pytest.raises(Refused, match="sent 2 32-bit words, not 6"):
        server.take_masked_input(short)
    vectors = inputs()
    for d in fleet:
        server.take_masked_input(d.masked_input(relayed[d.client], vectors[d.client]))
    signatures = signed_off(fleet, server, server.close_masked_input())
    answer = device.unmask(signatures[device.client])
    # A key share of a survivor (with its seed share withheld) would unmask its input.
    greedy = replace(
        answer,
        seed_shares={k: v for k, v in answer.seed_shares.items() if k != device.client},
        key_shares={device.client: answer.seed_shares[device.client]},
    )
    with pytest.raises(Refused, match="exactly the shares"):
        server.take_unmask(greedy)


def test_the_coordinator_refuses_a_replayed_key_under_another_name() -> None:
    fleet, server = staged(SPARSE)
    copy = replace(fleet[0].advertise(), client="dev-99")
    with pytest.raises(Refused, match="another device already holds"):
        server.take_advertise(copy)


def test_the_coordinator_holds_only_the_masked_sum_of_the_inputs() -> None:
    fleet, server = staged()
    rosters = server.close_advertise()
    for d in fleet:
        server.take_share(d.share(rosters[d.client]))
    relayed = server.close_share()
    vectors = {c: np.zeros(LENGTH) for c in CLIENTS}
    messages = [d.masked_input(relayed[d.client], vectors[d.client]) for d in fleet]
    # A zero input, masked, looks like noise: nothing in a device's message is its input.
    assert all(np.count_nonzero(m.vector()) == LENGTH for m in messages)
    for m in messages:
        server.take_masked_input(m)
    survivors = server.close_masked_input()
    # Nor anything the coordinator keeps: its only array is the masked sum, no zero in it.
    held = [v for v in vars(server).values() if isinstance(v, np.ndarray)]
    assert len(held) == 1 and np.count_nonzero(held[0]) == LENGTH
    signatures = signed_off(fleet, server, survivors)
    for d in fleet:
        server.take_unmask(d.unmask(signatures[d.client]))
    assert np.abs(server.close_unmask().total).max() < sum_error_bound(N, spec=SPEC)
