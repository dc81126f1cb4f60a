"""An adversarial coordinator for secure-aggregation tests (issue 51): the honest
in-memory coordinator around :class:`secagg.server.SecAggServer`, one method per stage,
and one driver that runs real devices (:class:`secagg.device.SecAggDevice`) against it,
every message through its wire encoding. A test subclasses :class:`Coordinator` and
overrides the stage it wants to lie at:

- :meth:`Coordinator.rosters`: substitute neighbours' keys, invent ids;
- :meth:`Coordinator.relay`: withhold, redirect or forge ciphertexts;
- :meth:`Coordinator.survivors`: equivocate (a different list for each device);
- :meth:`Coordinator.signatures`: relay the survivors' signed lists, or withhold or
  forge them;
- :meth:`Coordinator.result`: drop unmask answers, or bypass the server and combine the
  shares itself;
- :meth:`Coordinator.closes`: tell devices their input is, or is not, in the sum.

Each stage takes the devices' answers (client -> message) and returns what each device is
sent next. A device that refuses a message leaves the round, as it does over MQTT
(secagg/mqtt_device.py drops what it refuses), and the transcript keeps its refusal; so
does the honest server's refusal of a device's message (secagg/mqtt.py drops it). A lying
coordinator may run devices of its own under any id (:func:`puppet`): it holds their
private keys, as a coordinator that invents neighbours or substitutes keys would. Devices
of a signed fleet (:func:`devices` with ``ca``) sign their advertisements under
certificates of the fleet CA (tests/fleet_ca.py), which the coordinator does not hold.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from random import Random
from typing import Any, TypeVar

import numpy as np

from secagg.consistency import Consistency, Signatures, Survivors
from secagg.device import SecAggDevice
from secagg.errors import Refused, RoundAborted
from secagg.messages import (
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
from secagg.quantise import QuantiseSpec
from secagg.server import SecAggResult, SecAggServer
from secagg.settings import SecAggSettings
from tests.fleet_ca import TestCA

M = TypeVar("M", bound=SecAggMessage)
FLEET, ROUND, RUN = "lab", 5, "run-1"
SPEC = QuantiseSpec(clip=1.0, scale=2.0**16, bits=32)


def wire(message: M) -> M:
    """``message`` as the other side decodes it."""
    return type(message).from_wire(message.to_wire())


def clients(n: int) -> list[str]:
    return [f"dev-{i:02d}" for i in range(n)]


def settings(
    *, n: int, threshold: int, neighbours: int | None = None, quorum: int = 0
) -> SecAggSettings:
    """Settings for ``n`` devices of vectors of 6 values; ``neighbours`` None: the
    complete graph; ``quorum`` 0: ``threshold``."""
    k = n - 1 if neighbours is None else neighbours
    return SecAggSettings(threshold=threshold, neighbours=k, spec=SPEC, length=6, quorum=quorum)


def puppet(client: str, settings: SecAggSettings, *, seed: int) -> SecAggDevice:
    """A device the coordinator runs itself, under any id it likes."""
    return SecAggDevice(client=client, fleet=FLEET, round=ROUND, settings=settings,
                        rng=Random(seed))  # fmt: skip


def devices(
    settings: SecAggSettings, names: Sequence[str], *, ca: TestCA | None = None
) -> list[SecAggDevice]:
    """Honest devices; with ``ca``, of a signed fleet whose CA that is."""
    return [
        SecAggDevice(
            client=c,
            fleet=FLEET,
            round=ROUND,
            settings=settings,
            rng=Random(100 + i),
            enrolment=None if ca is None else ca.enrol(c, run=RUN),
        )
        for i, c in enumerate(names)
    ]


def inputs(names: Sequence[str], *, length: int = 6, seed: int = 1) -> dict[str, np.ndarray]:
    rows = np.random.default_rng(seed).uniform(-1.0, 1.0, size=(len(names), length))
    return dict(zip(names, rows, strict=True))


class LaxServer(SecAggServer):
    """The honest server less its check of the threshold against what enrolled devices
    take (:meth:`~secagg.server.SecAggServer.threshold_problem`): a lying coordinator
    need not abort a round its victims would refuse."""

    def threshold_problem(self) -> str | None:
        return None


class Coordinator:
    """The honest coordinator: each stage hands the devices' answers to the server and
    closes the stage. ``refused``: the server's refusals, by device. ``lax``: its server
    is a :class:`LaxServer`."""

    def __init__(self, *, settings: SecAggSettings, lax: bool = False) -> None:
        self.settings = settings
        server = LaxServer if lax else SecAggServer
        self.server = server(fleet=FLEET, round=ROUND, settings=settings)
        self.refused: dict[str, Refused] = {}

    def rosters(self, adverts: Mapping[str, Advertise]) -> Mapping[str, Roster]:
        self.take(self.server.take_advertise, adverts)
        return self.server.close_advertise()

    def relay(self, shares: Mapping[str, ShareKeys]) -> Mapping[str, RelayedShares]:
        self.take(self.server.take_share, shares)
        return self.server.close_share()

    def survivors(self, masked: Mapping[str, MaskedInput]) -> Mapping[str, Survivors]:
        self.take(self.server.take_masked_input, masked)
        return self.server.close_masked_input()

    def signatures(self, signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
        self.take(self.server.take_consistency, signed)
        return self.server.close_consistency()

    def result(self, unmasks: Mapping[str, Unmask]) -> SecAggResult:
        self.take(self.server.take_unmask, unmasks)
        return self.server.close_unmask()

    def closes(self) -> Mapping[str, Close]:
        return self.server.close_messages()

    def take(self, taker: Callable[[Any], None], answers: Mapping[str, SecAggMessage]) -> None:
        for client, message in answers.items():
            try:
                taker(message)
            except Refused as exc:
                self.refused[client] = exc


def signatures_as_told(signed: Mapping[str, Consistency]) -> Mapping[str, Signatures]:
    """What an equivocating coordinator relays: each device gets the signed lists of
    those told what it was told, the most it can be shown that it would take."""
    payload = {c: m.to_wire() for c, m in signed.items()}
    return {
        c: Signatures(fleet=FLEET, round=ROUND, client=c, signed={
            v: payload[v] for v, n in signed.items() if n.listed == m.listed
        })
        for c, m in signed.items()
    }  # fmt: skip


@dataclass
class Transcript:
    """What a round did: each stage's requests (what the coordinator sent each device)
    and answers, each device's refusal, and the result and the closes, or the abort."""

    requests: dict[Stage, dict[str, SecAggMessage]] = field(default_factory=dict)
    answers: dict[Stage, dict[str, SecAggMessage]] = field(default_factory=dict)
    refused: dict[str, Refused] = field(default_factory=dict)
    result: SecAggResult | None = None
    closes: dict[str, Close] = field(default_factory=dict)
    aborted: RoundAborted | None = None


def run_round(
    coordinator: Coordinator,
    fleet: Sequence[SecAggDevice],
    vectors: Mapping[str, np.ndarray],
    *,
    drop: Mapping[Stage, Collection[str]] | None = None,
) -> Transcript:
    """One round of ``fleet`` against ``coordinator``; ``drop[stage]`` go silent at
    ``stage`` (and stay gone). A request addressed to no device of ``fleet`` (an invented
    id, a puppet) is the coordinator's own business and goes nowhere."""
    gone = drop or {}
    alive = {d.client: d for d in fleet}
    transcript = Transcript()

    def answer(stage: Stage, requests: Mapping[str, M], respond: Callable[[SecAggDevice, M],
               SecAggMessage]) -> dict[str, Any]:  # fmt: skip
        for client in gone.get(stage, ()):
            alive.pop(client, None)
        transcript.requests[stage] = dict(requests)
        answers: dict[str, Any] = {}
        for client, request in requests.items():
            device = alive.get(client)
            if device is None:
                continue
            try:
                answers[client] = wire(respond(device, wire(request)))
            except Refused as exc:
                transcript.refused[client] = exc
                del alive[client]
        transcript.answers[stage] = answers
        return answers

    adverts = {c: wire(d.advertise()) for c, d in alive.items()}
    transcript.answers[Stage.ADVERTISE] = dict(adverts)
    try:
        rosters = coordinator.rosters(adverts)
        shares = answer(Stage.SHARE, rosters, lambda d, m: d.share(m))
        relayed = coordinator.relay(shares)
        masked = answer(Stage.MASKED_INPUT, relayed,
                        lambda d, m: d.masked_input(m, vectors[d.client]))  # fmt: skip
        survivors = coordinator.survivors(masked)
        signed = answer(Stage.CONSISTENCY, survivors, lambda d, m: d.consistency(m))
        signatures = coordinator.signatures(signed)
        unmasks = answer(Stage.UNMASK, signatures, lambda d, m: d.unmask(m))
        transcript.result = coordinator.result(unmasks)
        transcript.closes = {c: wire(m) for c, m in coordinator.closes().items()}
    except RoundAborted as exc:
        transcript.aborted = exc
    return transcript
