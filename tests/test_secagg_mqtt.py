"""Secure aggregation over a real Mosquitto: 20 device links (threads of this process, each
with its own connection, Ed25519 key and certificate of a fleet CA) and the coordinator's
link run whole rounds.

The unmasked sum equals the plain sum within the quantisation bound, with a third of the
devices leaving after each stage, and at every stage in turn; too few survivors abort the
round and every device still there hears why; forged stage messages are dropped and
counted on both sides; and nothing the coordinator side logs or holds is a device's input.
The wire's checks come first, without a broker."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from random import Random

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fleet.transports.broker import BrokerAddress, MosquittoBroker
from protocol.auth import Signer, sign
from protocol.topics import secagg_down_topic, secagg_up_topic
from runtime.transport import MqttSettings
from secagg.device import SecAggDevice
from secagg.enrolled import Enrolment
from secagg.errors import RoundAborted
from secagg.messages import Abort, Advertise, Close, PublicKeys, Roster, Stage
from secagg.mqtt import SecAggCoordinatorLink, StageDeadlines
from secagg.mqtt_device import SecAggDeviceLink
from secagg.quantise import QuantiseSpec, sum_error_bound
from secagg.server import SecAggResult, SecAggServer
from secagg.settings import SecAggSettings
from secagg.wire import CoordinatorWire, DeviceWire
from tests.fleet_ca import NOW, TestCA
from tests.mqtt_helpers import connected
from tests.test_mqtt_link import Lines, attached_lines

LOG = logging.getLogger(__name__)
FLEET, ROUND, RUN = "lab", 5, "0123456789abcdef"
N = 20
LENGTH = 6
SPEC = QuantiseSpec(clip=1.0, scale=2.0**16, bits=32)
COMPLETE = SecAggSettings(threshold=5, neighbours=N - 1, spec=SPEC, length=LENGTH)
SPARSE = SecAggSettings(threshold=4, neighbours=8, spec=SPEC, length=LENGTH)
#: A signed fleet's devices need 2t > (holders) + c: t 11 of the 20 on the complete graph.
SIGNED = SecAggSettings(threshold=11, neighbours=N - 1, spec=SPEC, length=LENGTH)
CLIENTS = [f"dev-{i:02d}" for i in range(N)]
#: A third of the fleet: every third device, which the seeded shuffle scatters over the graph.
THIRD = CLIENTS[::3]
#: Long enough for 20 devices' crypto on a busy 2-core machine; a stage somebody leaves
#: waits it out, one with every answer in closes at once.
STAGE_S = 3.0


def ed25519(seed: int) -> Signer:
    return Signer(_key(seed))


def _key(seed: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(Random(seed).randbytes(32))


COORDINATOR_KEY = ed25519(1000)
DEVICE_KEYS = {c: ed25519(i) for i, c in enumerate(CLIENTS)}
#: The fleet CA's certificate for each device's key: the devices check each other's.
CA = TestCA()
ENROLMENTS = {
    c: Enrolment(
        client=c,
        signer=DEVICE_KEYS[c],
        certificate=CA.issue(c, _key(i)),
        ca=CA.certificate,
        run=RUN,
        clock=NOW,
    )
    for i, c in enumerate(CLIENTS)
}


def inputs(seed: int = 1) -> dict[str, np.ndarray]:
    rows = np.random.default_rng(seed).uniform(-1.0, 1.0, size=(N, LENGTH))
    return dict(zip(CLIENTS, rows, strict=True))


def plain_sum(vectors: Mapping[str, np.ndarray], clients: list[str]) -> np.ndarray:
    return np.sum([np.clip(vectors[c], -SPEC.clip, SPEC.clip) for c in clients], axis=0)


def coordinator_wire(*, signed: bool = True, logger: logging.Logger = LOG) -> CoordinatorWire:
    return CoordinatorWire(
        fleet=FLEET,
        run=RUN,
        signer=COORDINATOR_KEY if signed else None,
        devices={c: key.public for c, key in DEVICE_KEYS.items()},
        logger=logger,
    )


def device_wire(client: str, *, signed: bool = True, logger: logging.Logger) -> DeviceWire:
    return DeviceWire(
        fleet=FLEET,
        client=client,
        run=RUN,
        signer=DEVICE_KEYS[client] if signed else None,
        coordinator=COORDINATOR_KEY.public if signed else None,
        logger=logger,
    )


@dataclass
class Fleet:
    coordinator: SecAggCoordinatorLink
    devices: dict[str, SecAggDeviceLink]
    vectors: dict[str, np.ndarray]

    def run(self) -> SecAggResult:
        """Connect the devices (the coordinator listens already) and run the round."""
        for link in self.devices.values():
            link.start()
        return self.coordinator.run()


@contextmanager
def fleet(
    address: BrokerAddress,
    settings: SecAggSettings,
    *,
    leave: Mapping[str, Stage] | None = None,
    logger: logging.Logger,
    device_logger: logging.Logger | None = None,
    seed: int = 1,
    enrolled: bool = False,
    release: Callable[[str], bool] | None = None,
) -> Iterator[Fleet]:
    """A listening coordinator link and 20 device links not yet started; ``leave[c]``:
    device ``c`` disconnects once it has answered that stage; ``enrolled``: the devices
    check each other's keys under the fleet CA (secagg/enrolled.py); ``release(c)``: what
    device ``c``'s link calls before its masked input leaves (a ledger's charge)."""
    mqtt = MqttSettings(host=address.host, port=address.port)
    vectors = inputs(seed)
    coordinator = SecAggCoordinatorLink(
        server=SecAggServer(fleet=FLEET, round=ROUND, settings=settings),
        wire=coordinator_wire(logger=logger),
        mqtt_settings=mqtt,
        client_id="coordinator",
        deadlines=StageDeadlines(
            advertise=30.0,
            share=STAGE_S,
            masked_input=STAGE_S,
            consistency=STAGE_S,
            unmask=STAGE_S,
        ),
        expected=CLIENTS,
        logger=logger,
    )
    devices: dict[str, SecAggDeviceLink] = {}
    for i, c in enumerate(CLIENTS):
        device = SecAggDevice(client=c, fleet=FLEET, round=ROUND, settings=settings,
                              rng=Random(100 + i),
                              enrolment=ENROLMENTS[c] if enrolled else None)  # fmt: skip
        devices[c] = SecAggDeviceLink(
            device=device,
            vector=vectors[c],
            wire=device_wire(c, logger=device_logger or logger),
            mqtt_settings=mqtt,
            on_answered=_leaving(devices, c, (leave or {}).get(c)),
            release=None if release is None else partial(release, c),
            logger=device_logger or logger,
        )
    with ExitStack() as stack:
        stack.enter_context(coordinator)
        assert coordinator.link.wait_connected(10)
        for link in devices.values():
            stack.callback(link.close)
        yield Fleet(coordinator=coordinator, devices=devices, vectors=vectors)


def _leaving(
    devices: Mapping[str, SecAggDeviceLink], client: str, stage: Stage | None
) -> Callable[[Stage], None]:
    def answered(done: Stage) -> None:
        if done is stage:
            devices[client].close()

    return answered


@pytest.fixture
def lines(request: pytest.FixtureRequest) -> Iterator[Lines]:
    yield from attached_lines(request, prefix="tests.secagg_mqtt")


@pytest.fixture
def device_lines(request: pytest.FixtureRequest) -> Iterator[Lines]:
    yield from attached_lines(request, prefix="tests.secagg_mqtt.devices")


def within_bound(result: SecAggResult, vectors: Mapping[str, np.ndarray]) -> bool:
    counted = list(result.survivors)
    error = np.abs(result.total - plain_sum(vectors, counted))
    return bool(error.max() < sum_error_bound(len(counted), spec=SPEC))


# Over a real broker.


@pytest.mark.broker
@pytest.mark.parametrize("enrolled", [False, True], ids=["sparse", "complete-enrolled"])
def test_over_mosquitto_the_unmasked_sum_is_the_plain_sum(
    mosquitto: MosquittoBroker, lines: Lines, enrolled: bool
) -> None:
    settings = SIGNED if enrolled else SPARSE
    with fleet(mosquitto.address, settings, logger=lines.logger, enrolled=enrolled) as f:
        result = f.run()
        assert all(link.wait_finished(10) for link in f.devices.values())
        assert result.survivors == tuple(CLIENTS)
        assert within_bound(result, f.vectors)
        assert all(link.answered == tuple(Stage) for link in f.devices.values())
        # Each device hears from the coordinator that its input is in the sum.
        closes = [link.wait_settled(10) for link in f.devices.values()]
        assert all(isinstance(c, Close) and c.summed for c in closes)
        assert f.coordinator.drops.counts() == {}
        # No device refused (enrolled: each took its neighbours' keys from their adverts).
        assert all(link.drops.counts() == {} for link in f.devices.values())


@pytest.mark.broker
def test_the_coordinator_side_neither_logs_nor_holds_a_device_input(
    mosquitto: MosquittoBroker, lines: Lines
) -> None:
    with fleet(mosquitto.address, COMPLETE, logger=lines.logger) as f:
        result = f.run()
    assert within_bound(result, f.vectors)
    logged = "\n".join(lines.lines)
    assert "the sum of 20 devices' inputs is unmasked" in logged
    for vector in f.vectors.values():
        for value in vector:
            assert f"{value:.4f}" not in logged and repr(float(value)) not in logged
    # What the link and its round keep: one array, the masked sum of the 32-bit ring,
    # whose decoding is nowhere near any one input (it is not even within the clip).
    coordinator = f.coordinator
    held = [v for obj in (coordinator, coordinator.server) for v in vars(obj).values()]
    arrays = [v for v in held if isinstance(v, np.ndarray)]
    assert len(arrays) == 1 and arrays[0].dtype == np.uint32
    ring = arrays[0].astype(np.int64)
    decoded = np.where(ring >= 2**31, ring - 2**32, ring) / SPEC.scale
    assert all(np.abs(decoded - v).max() > 1.0 for v in f.vectors.values())
    assert coordinator._inbox.empty()


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize(
    ("left", "dropped_at"),
    [
        (Stage.ADVERTISE, Stage.SHARE),
        (Stage.SHARE, Stage.MASKED_INPUT),
        (Stage.MASKED_INPUT, Stage.CONSISTENCY),
    ],
)
def test_a_third_leaving_after_one_stage_still_recovers_the_survivors_sum(
    mosquitto: MosquittoBroker, lines: Lines, left: Stage, dropped_at: Stage
) -> None:
    with fleet(
        mosquitto.address, SPARSE, leave=dict.fromkeys(THIRD, left), logger=lines.logger
    ) as f:
        result = f.run()
    # Whoever left before sending a masked input is not in the sum; after, still is.
    counted = CLIENTS if left is Stage.MASKED_INPUT else [c for c in CLIENTS if c not in THIRD]
    assert result.survivors == tuple(counted)
    assert result.dropped[dropped_at] == tuple(THIRD)
    assert within_bound(result, f.vectors)


@pytest.mark.broker
@pytest.mark.slow
def test_a_third_leaving_at_every_stage_in_turn_still_recovers(
    mosquitto: MosquittoBroker, lines: Lines
) -> None:
    # 20 advertise; 7 leave (13 share); 5 of those leave (8 mask); 3 of those leave (5 sign
    # the survivors and unmask).
    rest = [c for c in CLIENTS if c not in THIRD]
    masked = [c for c in rest if c not in rest[::3]]
    leave = {
        **dict.fromkeys(THIRD, Stage.ADVERTISE),
        **dict.fromkeys(rest[::3], Stage.SHARE),
        **dict.fromkeys(masked[::3], Stage.MASKED_INPUT),
    }
    with fleet(mosquitto.address, COMPLETE, leave=leave, logger=lines.logger, seed=2) as f:
        result = f.run()
    assert result.survivors == tuple(masked)
    assert result.dropped == {
        Stage.SHARE: tuple(THIRD),
        Stage.MASKED_INPUT: tuple(rest[::3]),
        Stage.CONSISTENCY: tuple(masked[::3]),
        Stage.UNMASK: (),
    }
    assert within_bound(result, f.vectors)


@pytest.mark.broker
@pytest.mark.slow
def test_fewer_than_t_survivors_abort_and_every_remaining_device_hears_why(
    mosquitto: MosquittoBroker, lines: Lines
) -> None:
    stay = CLIENTS[:4]
    leave = {c: Stage.SHARE for c in CLIENTS if c not in stay}
    reason = "4 devices sent masked inputs, fewer than the threshold t = 5"
    with fleet(mosquitto.address, COMPLETE, leave=leave, logger=lines.logger) as f:
        with pytest.raises(RoundAborted, match=reason) as caught:
            f.run()
        assert caught.value.stage == Stage.MASKED_INPUT.value
        for c in stay:
            link = f.devices[c]
            assert link.wait_finished(10)
            notice = link.abort
            assert notice is not None and (notice.stage, notice.reason) == (
                Stage.MASKED_INPUT,
                reason,
            )
            assert link.answered == (Stage.ADVERTISE, Stage.SHARE, Stage.MASKED_INPUT)
    assert f"aborted at masked_input: {reason}; telling 20 devices" in "\n".join(lines.lines)


@pytest.mark.broker
def test_a_device_the_coordinator_excludes_hears_why_and_the_round_goes_on(
    mosquitto: MosquittoBroker, lines: Lines, device_lines: Lines
) -> None:
    with fleet(
        mosquitto.address, SPARSE, logger=lines.logger, device_logger=device_lines.logger
    ) as f:
        weak = f.devices["dev-03"].device
        weak.public = dataclasses.replace(weak.public, s=bytes(32))  # u = 0: small order
        result = f.run()
        assert result.survivors == tuple(c for c in CLIENTS if c != "dev-03")
        link = f.devices["dev-03"]
        assert link.wait_finished(10) and link.abort is not None
        why = "this device is refused: advertised a public key of small order"
        assert (link.abort.stage, link.abort.reason) == (Stage.ADVERTISE, why)
        device_lines.wait(f"dev-03: secure aggregation round 5 aborted at advertise: {why}")
        assert f.coordinator.drops.counts() == {"excluded": 1}


@pytest.mark.broker
def test_forged_stage_messages_are_dropped_and_counted_on_both_sides(
    mosquitto: MosquittoBroker, lines: Lines, device_lines: Lines
) -> None:
    stranger = ed25519(999)
    keys = PublicKeys(c=bytes(range(32)), s=bytes(range(1, 33)))
    forged_keys = Advertise(fleet=FLEET, round=ROUND, client="dev-03", keys=keys)
    unsigned_keys = dataclasses.replace(forged_keys, client="dev-04")
    with fleet(
        mosquitto.address, SPARSE, logger=lines.logger, device_logger=device_lines.logger
    ) as f:
        with connected(mosquitto.address, "forger") as (forger, _):
            # Before any device: were either taken, the real dev-03 and dev-04 would be
            # refused as sending a second, different advertisement.
            for message in (sign(forged_keys, stranger, run=RUN), unsigned_keys):
                info = forger.publish(
                    secagg_up_topic(FLEET, message.client), message.to_wire(), qos=1
                )
                info.wait_for_publish(10)
            result = f.run()
            assert result.survivors == tuple(CLIENTS)
            assert f.coordinator.drops.counts() == {"bad_signature": 1, "unsigned": 1}
            # To finished devices: a roster under another key, an abort unsigned.
            roster = Roster(
                fleet=FLEET,
                round=ROUND,
                client="dev-05",
                clients=("dev-05",),
                keys={"dev-05": keys},
            )
            abort = Abort(
                fleet=FLEET, round=ROUND, client="dev-06", stage=Stage.UNMASK, reason="forged"
            )
            for notice in (sign(roster, stranger, run=RUN), abort):
                info = forger.publish(
                    secagg_down_topic(FLEET, notice.client), notice.to_wire(), qos=1
                )
                info.wait_for_publish(10)
            device_lines.wait("dropped a secagg_roster for dev-05: bad_signature")
            device_lines.wait("dropped a secagg_abort for dev-06: unsigned")
        assert f.devices["dev-05"].drops.counts() == {"bad_signature": 1}
        assert f.devices["dev-06"].drops.counts() == {"unsigned": 1}
        assert f.devices["dev-06"].abort is None


# The wire, without a broker.


def _advertise(client: str = "dev-01") -> Advertise:
    return SecAggDevice(
        client=client, fleet=FLEET, round=ROUND, settings=SPARSE, rng=Random(7)
    ).advertise()


def test_a_signed_message_is_taken_under_its_enrolled_key_only(lines: Lines) -> None:
    wire = coordinator_wire(logger=lines.logger)
    honest = device_wire("dev-01", logger=lines.logger).encode(_advertise())
    assert wire.decode(honest, sender="dev-01") == sign(
        _advertise(), DEVICE_KEYS["dev-01"], run=RUN
    )
    cases = {
        "client_mismatch": (honest, "dev-02"),
        "unsigned": (_advertise().to_wire(), "dev-01"),
        "bad_signature": (sign(_advertise(), DEVICE_KEYS["dev-02"], run=RUN).to_wire(), "dev-01"),
        "wrong_run": (
            sign(_advertise(), DEVICE_KEYS["dev-01"], run="fedcba9876543210").to_wire(),
            "dev-01",
        ),
        "unenrolled": (sign(_advertise("dev-99"), ed25519(99), run=RUN).to_wire(), "dev-99"),
        "wrong_fleet": (dataclasses.replace(_advertise(), fleet="other").to_wire(), "dev-01"),
        "kind": (
            Abort(
                fleet=FLEET, round=ROUND, client="dev-01", stage=Stage.SHARE, reason="x"
            ).to_wire(),
            "dev-01",
        ),
        "malformed": (b"\xc1", "dev-01"),
        "version": (honest.replace(b"\xa1v\x03", b"\xa1v\x09"), "dev-01"),
    }
    for payload, sender in cases.values():
        assert wire.decode(payload, sender=sender) is None
    assert wire.drops.counts() == dict.fromkeys(cases, 1)
    assert (
        "dropped a secagg_advertise on the secure-aggregation topic of dev-02: "
        "client_mismatch (1 so far)" in lines.lines
    )


def test_a_device_takes_only_what_the_pinned_coordinator_signed_for_it(lines: Lines) -> None:
    wire = device_wire("dev-01", logger=lines.logger)
    notice = Abort(fleet=FLEET, round=ROUND, client="dev-01", stage=Stage.SHARE, reason="x")
    assert wire.decode(coordinator_wire().encode(notice)) == sign(notice, COORDINATOR_KEY, run=RUN)
    other = dataclasses.replace(notice, client="dev-02")
    for payload in (
        coordinator_wire().encode(other),
        notice.to_wire(),
        sign(notice, DEVICE_KEYS["dev-01"], run=RUN).to_wire(),
        coordinator_wire().encode(_advertise()),
    ):
        assert wire.decode(payload) is None
    assert wire.drops.counts() == {
        "client_mismatch": 1,
        "unsigned": 1,
        "bad_signature": 1,
        "kind": 1,
    }


def test_an_insecure_fleet_neither_signs_nor_checks(lines: Lines) -> None:
    device = device_wire("dev-01", signed=False, logger=lines.logger)
    payload = device.encode(_advertise())
    assert payload == _advertise().to_wire()  # no auth on the wire
    assert coordinator_wire(signed=False).decode(payload, sender="dev-01") == _advertise()
    with pytest.raises(ValueError, match="coordinator's key"):
        DeviceWire(
            fleet=FLEET, client="dev-01", run=RUN, signer=DEVICE_KEYS["dev-01"], coordinator=None
        )


def test_a_flood_of_one_reason_is_logged_at_powers_of_two(lines: Lines) -> None:
    wire = coordinator_wire(logger=lines.logger)
    for _ in range(9):
        wire.decode(b"\xc1", sender="dev-01")
    assert wire.drops.counts() == {"malformed": 9}
    assert [line.rsplit("(", 1)[1] for line in lines.lines] == [
        "1 so far)",
        "2 so far)",
        "4 so far)",
        "8 so far)",
    ]


def test_stage_deadlines_must_be_positive() -> None:
    with pytest.raises(ValueError, match="the share deadline must be positive"):
        StageDeadlines(advertise=1.0, share=0.0, masked_input=1.0, consistency=1.0, unmask=1.0)
