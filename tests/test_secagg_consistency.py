"""The consistency stage (secagg/consistency.py, issue 51): no device releases a share
before at least ``t`` survivors, itself among them, signed the very survivor list it
holds; in a signed fleet each signature must be the survivor's own, under the fleet CA.
Driven by the adversarial-coordinator harness (tests/secagg_harness.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.auth import Signer, sign
from secagg.consistency import Consistency, Signatures, Survivors, list_digest, roster_digest
from secagg.device import SecAggDevice
from secagg.errors import RoundAborted
from secagg.messages import Stage, Unmask
from secagg.server import SecAggResult
from tests.fleet_ca import TestCA
from tests.secagg_harness import (
    FLEET,
    ROUND,
    RUN,
    Coordinator,
    clients,
    devices,
    inputs,
    run_round,
    settings,
    signatures_as_told,
)

N = 20
NAMES = clients(N)
#: 2t > n + c: what a signed fleet of 20 takes on the complete graph.
GRAPH = settings(n=N, threshold=11)
CA = TestCA()
VICTIM = "dev-00"


class Splitter(Coordinator):
    """Tells ``told`` that the victim dropped and everyone else that it survived, then
    relays to each device the signed lists of those told what it was told."""

    def __init__(self, *, told: set[str]) -> None:
        super().__init__(settings=GRAPH, lax=True)
        self.told = told

    def survivors(self, masked: Mapping[str, object]) -> Mapping[str, Survivors]:
        honest = super().survivors(masked)  # type: ignore[arg-type]
        without = tuple(c for c in honest[VICTIM].listed(NAMES) if c != VICTIM)
        return {c: replace(m, survivors=without, marks=b"") if c in self.told else m
                for c, m in honest.items()}  # fmt: skip

    def signatures(self, signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
        return signatures_as_told(signed)

    def result(self, unmasks: Mapping[str, Unmask]) -> SecAggResult:
        # Its server never saw the lists it split: it has nothing but what came back.
        raise RoundAborted(f"{len(unmasks)} devices sent shares", round=ROUND, stage="unmask")


@pytest.mark.parametrize("signed", [False, True], ids=["insecure", "signed"])
def test_devices_shown_different_survivor_lists_release_no_share(signed: bool) -> None:
    # Ten devices hear the victim dropped, ten (the victim among them) that it survived:
    # neither list gathers t = 11 signatures, so no share of anything leaves a device.
    # Before the consistency stage every device answered with its shares at once.
    told = set(NAMES[10:])
    fleet = devices(GRAPH, NAMES, ca=CA if signed else None)
    transcript = run_round(Splitter(told=told), fleet, inputs(NAMES))
    assert set(transcript.answers[Stage.CONSISTENCY]) == set(NAMES)
    assert transcript.answers[Stage.UNMASK] == {}
    assert transcript.result is None
    assert "10 survivors signed its survivor list, fewer than t = 11" in str(
        transcript.refused[VICTIM]
    )


class Forger(Coordinator):
    """Relays the honest signed lists, with ``forge`` applied to dev-01's."""

    def __init__(self, *, forge: str) -> None:
        super().__init__(settings=GRAPH)
        self.forge = forge

    def signatures(self, signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
        honest = super().signatures(signed)
        real = signed["dev-01"]
        if self.forge == "another-list":
            fake = sign(replace(real, listed=list_digest(NAMES[:-1])), Signer(KEY), run=RUN)
        elif self.forge == "own-key":
            fake = sign(real, Signer(KEY), run=RUN)
        elif self.forge == "another-round":
            fake = replace(real, round=ROUND + 1)
        elif self.forge == "without-its-own":
            kept = {v: p for v, p in honest[VICTIM].signed.items() if v != VICTIM}
            return {**honest, VICTIM: replace(honest[VICTIM], signed=kept)}
        elif self.forge == "another-roster":
            # What dev-01 signs when it was shown another roster: its own signature.
            fake = DEV01.sign(replace(real, roster=roster_digest(NAMES[:-1])))
        else:
            fake = replace(real, auth=None)
        forged = {**honest[VICTIM].signed, "dev-01": fake.to_wire()}
        return {**honest, VICTIM: replace(honest[VICTIM], signed=forged)}


KEY = Ed25519PrivateKey.generate()
DEV01 = CA.enrol("dev-01", run=RUN)
FORGED = {
    "without-its-own": "its own signed survivor list is not among the signatures",
    "another-roster": "a survivor was sent another roster than this device (dev-01)",
    "another-list": "a survivor signed another survivor list than this device's (dev-01)",
    "own-key": "a survivor's signed list is not signed by its enrolled key (bad_signature)",
    "another-round": "a survivor's signed list is another device's or another round's",
    "unsigned": "a survivor's signed list is not signed by its enrolled key (unsigned)",
}


@pytest.mark.parametrize("forge", list(FORGED))
def test_a_signed_device_releases_no_share_on_a_forged_signed_list(forge: str) -> None:
    fleet = devices(GRAPH, NAMES, ca=CA)
    fleet[1] = SecAggDevice(client="dev-01", fleet=FLEET, round=ROUND, settings=GRAPH,
                            enrolment=DEV01)  # fmt: skip
    transcript = run_round(Forger(forge=forge), fleet, inputs(NAMES))
    assert VICTIM not in transcript.answers[Stage.UNMASK]
    assert FORGED[forge] in str(transcript.refused[VICTIM])
    assert set(transcript.refused) == {VICTIM}


def test_an_honest_round_relays_every_survivors_signed_list() -> None:
    transcript = run_round(Coordinator(settings=GRAPH), devices(GRAPH, NAMES, ca=CA),
                           inputs(NAMES), drop={Stage.CONSISTENCY: {"dev-19"}})  # fmt: skip
    assert transcript.refused == {} and transcript.result is not None
    relayed = transcript.requests[Stage.UNMASK]
    assert set(relayed) == set(NAMES) - {"dev-19"}
    assert all(isinstance(m, Signatures) and set(m.signed) == set(relayed)
               for m in relayed.values())  # fmt: skip
    # dev-19's masked input is in the sum though it signed nothing.
    assert "dev-19" in transcript.result.survivors
