"""What a secure fleet's running sum holds of each device, checked against each device's
own view before its input goes in (coordinator/rounds/secure_record.py, issue 51): a
device whose close was lost is told what the sum holds instead of counting its data
twice; a sum restored behind the devices starts again, shown by a receipt the coordinator
signed; and a device that claims so without one cannot make the fleet start again."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from random import Random

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import closed_form as cf
from coordinator.config import PrivacySettings
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.secure import SUM_KEY, FleetSum, SecureOutcome
from coordinator.rounds.secure_record import RecordedServer
from coordinator.storage.store import Store
from protocol.auth import Signer, sign
from secagg.device import SecAggDevice
from secagg.errors import Excluded
from secagg.fleet import SINCE_EXTRA, SecureAggregation, flatten, secure_release
from secagg.messages import Abort, Close, Stage
from secagg.result import SecAggResult
from secagg.wire import CoordinatorWire
from tests.coordinator_helpers import CLASSES, DIM, config
from tests.secagg_harness import FLEET, ROUND, Coordinator, clients, inputs, run_round, settings
from tests.test_run_recovery import Clock, snapshot, status

RUN = "0123456789abcdef"
NAMES = clients(5)
GRAPH = settings(n=5, threshold=3)
KEY = Signer(Ed25519PrivateKey.generate())
WIRE = CoordinatorWire(fleet=FLEET, run=RUN, signer=KEY, devices={})


def receipt(
    client: str, round_: int, *, key: Signer = KEY, run: str = RUN, **kind: object
) -> bytes:
    """The coordinator's signed close of ``round_`` to ``client`` (summed unless told), or
    with ``holds``, its abort saying what the sum holds."""
    if "holds" in kind:
        message: Close | Abort = Abort(fleet=FLEET, round=round_ + 1, client=client,
                                       stage=Stage.ADVERTISE, reason="held", holds=kind["holds"])  # type: ignore[arg-type]  # fmt: skip
    else:
        message = Close(fleet=FLEET, round=round_, client=client,
                        summed=bool(kind.get("summed", True)))  # fmt: skip
    return sign(message, key, run=run).to_wire()


def test_a_receipt_is_the_coordinators_own_signed_word_for_that_device() -> None:
    assert WIRE.receipt_round("dev-00", receipt("dev-00", 4)) == 4
    assert WIRE.receipt_round("dev-00", receipt("dev-00", 6, holds=4)) == 4
    refused = {
        "left out of its round": receipt("dev-00", 4, summed=False),
        "an abort that names no round": receipt("dev-00", 6, holds=-1),
        "another device's": receipt("dev-01", 4),
        "another coordinator's": receipt("dev-00", 4, key=Signer(Ed25519PrivateKey.generate())),
        "another run's": receipt("dev-00", 4, run="fedcba9876543210"),
        "no receipt": b"",
        "not a message": b"\x81\xa4type\xa5round",
    }
    for why, payload in refused.items():
        assert WIRE.receipt_round("dev-00", payload) is None, why


class Recorded(Coordinator):
    """The honest coordinator over a :class:`RecordedServer` holding ``held``."""

    def __init__(self, held: Mapping[str, int]) -> None:
        super().__init__(settings=GRAPH)
        self.server = RecordedServer(held=held, receipt_round=WIRE.receipt_round, fleet=FLEET,
                                     round=ROUND, settings=GRAPH)  # fmt: skip


def fleet(views: Mapping[str, tuple[int, bytes]]) -> list[SecAggDevice]:
    """Devices that believe the sum holds their input of the round given (-1: none)."""
    return [
        SecAggDevice(client=c, fleet=FLEET, round=ROUND, settings=GRAPH, rng=Random(i),
                     summed=views.get(c, (-1, b""))[0], receipt=views.get(c, (-1, b""))[1])
        for i, c in enumerate(NAMES)
    ]  # fmt: skip


def test_devices_that_agree_with_the_record_take_part() -> None:
    held = {c: 2 for c in NAMES[1:]}
    views = {c: (2, receipt(c, 2)) for c in NAMES[1:]}
    transcript = run_round(Recorded(held), fleet(views), inputs(NAMES))
    assert transcript.result is not None and transcript.result.survivors == tuple(NAMES)


def test_a_device_whose_close_was_lost_is_told_what_the_sum_holds_and_kept_out() -> None:
    # dev-00's input of round 3 is in the sum, but its close never came: it still believes
    # the sum holds round 2's, and would add its statistics less round 2's again.
    coordinator = Recorded({c: 3 if c == "dev-00" else 2 for c in NAMES})
    views = {c: (2, receipt(c, 2)) for c in NAMES}
    transcript = run_round(coordinator, fleet(views), inputs(NAMES))
    refusal = coordinator.refused["dev-00"]
    assert isinstance(refusal, Excluded) and refusal.holds == 3
    assert refusal.why == "the fleet's sum holds its input of round 3, not what it says (round 2)"
    assert transcript.result is not None and transcript.result.survivors == tuple(NAMES[1:])


@pytest.mark.parametrize(
    "claim",
    [b"", receipt("dev-00", 3), receipt("dev-01", 5),
     receipt("dev-00", 5, key=Signer(Ed25519PrivateKey.generate()))],
    ids=["none", "another-round", "another-device", "forged"],
)  # fmt: skip
def test_one_device_cannot_make_the_fleet_start_again_without_a_receipt(claim: bytes) -> None:
    coordinator = Recorded({c: 2 for c in NAMES})
    views = {c: (2, receipt(c, 2)) for c in NAMES[1:]} | {"dev-00": (5, claim)}
    transcript = run_round(coordinator, fleet(views), inputs(NAMES))
    refusal = coordinator.refused["dev-00"]
    assert isinstance(refusal, Excluded) and refusal.holds == 2
    assert isinstance(coordinator.server, RecordedServer) and coordinator.server.behind == {}
    assert transcript.result is not None and "dev-00" not in transcript.result.survivors


def test_a_sum_behind_a_devices_receipt_aborts_the_round_and_starts_again() -> None:
    # The database was restored from a backup: it runs round 5 again, holds dev-00's input
    # of round 2, and dev-00 holds the coordinator's signed close of round 7.
    coordinator = Recorded({c: 2 for c in NAMES})
    views = {c: (2, receipt(c, 2)) for c in NAMES[1:]} | {"dev-00": (7, receipt("dev-00", 7))}
    transcript = run_round(coordinator, fleet(views), inputs(NAMES))
    assert transcript.aborted is not None and transcript.aborted.stage == Stage.ADVERTISE.value
    assert transcript.aborted.why == (
        "the fleet's sum is behind 1 device(s): it holds round 2 of dev-00, whose receipt "
        "shows its input of round 7 in it; the sum starts again from round 8"
    )
    assert isinstance(coordinator.server, RecordedServer)
    assert coordinator.server.behind == {"dev-00": 7}
    # Past the receipt's round, not the next one: rounds 6 and 7 run again, and receipts
    # of the old ones must not count in the new sum.
    assert ROUND == 5 and coordinator.server.restart == 8
    assert transcript.answers.get(Stage.SHARE, {}) == {}  # no share left any device


def test_rounds_before_a_sum_started_again_begins_take_no_input() -> None:
    coordinator = Recorded({})
    coordinator.server = RecordedServer(held={}, since=ROUND + 2, receipt_round=WIRE.receipt_round,
                                        fleet=FLEET, round=ROUND, settings=GRAPH)  # fmt: skip
    transcript = run_round(coordinator, fleet({}), inputs(NAMES))
    assert transcript.aborted is not None
    assert transcript.aborted.why == f"the fleet's sum starts again from round {ROUND + 2}"
    assert coordinator.server.restart == 0  # nobody showed it behind: no second restart


def test_the_running_sum_records_whose_inputs_it_holds_and_starts_again_from_the_next_round() -> (
    None
):
    release = secure_release(SecureAggregation(threshold=2, epsilon=0.0, dataset_size=10),
                             k=2, classes=2, gram=True)  # fmt: skip
    total = np.arange(release.settings.length, dtype=np.float64)
    first = FleetSum.empty(release).plus(
        SecureOutcome(round=3, total=total, survivors=2, contributors=("a", "b")), release
    )
    second = first.plus(SecureOutcome(round=4, total=total, survivors=1, contributors=("b",)),
                        release)  # fmt: skip
    assert second.held == {"a": 3, "b": 4} and second.since == 0 and second.devices == 3
    # An abort changes nothing; one because the sum is behind empties it from round 6.
    assert second.plus(SecureOutcome(round=5, total=None), release) is second
    restarted = second.plus(SecureOutcome(round=5, total=None, restart=6), release)
    assert restarted.held == {} and restarted.since == 6 and restarted.devices == 0
    back = FleetSum.load(second.to_meta(), release=release)
    assert (back.held, back.since, back.devices) == (second.held, 0, 3)
    assert FleetSum.load(restarted.to_meta(), release=release).since == 6


def held_by(m: RoundManager) -> tuple[dict[str, int], int]:
    running = m.secure_sum()
    assert running is not None
    return dict(running.held), running.since


def test_a_receipt_of_a_round_before_the_sum_began_is_none_and_restarts_nothing() -> None:
    # After a restart from round 8, a device replays its valid close of round 5: the new
    # sum holds nothing of round 5, and the device's own view says none as well.
    coordinator = Recorded({})
    coordinator.server = RecordedServer(held={}, since=ROUND, receipt_round=WIRE.receipt_round,
                                        fleet=FLEET, round=ROUND, settings=GRAPH)  # fmt: skip
    views = {"dev-00": (ROUND - 1, receipt("dev-00", ROUND - 1))}
    transcript = run_round(coordinator, fleet(views), inputs(NAMES))
    assert transcript.result is not None and transcript.result.survivors == tuple(NAMES)
    assert coordinator.server.behind == {} and coordinator.server.restart == 0


def test_a_restart_never_begins_before_the_sum_it_replaces_did() -> None:
    server = RecordedServer(held={}, since=ROUND + 3, receipt_round=WIRE.receipt_round,
                            fleet=FLEET, round=ROUND, settings=GRAPH)  # fmt: skip
    server.behind["dev-00"] = ROUND + 3
    assert server.restart == ROUND + 4
    server.behind["dev-00"] = ROUND - 1  # (not taken: below since; the bound holds anyway)
    assert server.restart == ROUND + 3


def test_a_round_whose_sum_fails_admission_aborts_and_closes_nobody_as_summed() -> None:
    # Before, the closes said "summed" and the tally then left the sum out: the devices
    # believed their inputs in, and their receipts later showed the sum behind them.
    coordinator = Recorded({})
    seen: list[int] = []

    def refuse(result: SecAggResult) -> str:
        seen.append(len(result.survivors))
        return "a count below zero"

    coordinator.server = RecordedServer(held={}, receipt_round=WIRE.receipt_round, admit=refuse,
                                        fleet=FLEET, round=ROUND, settings=GRAPH)  # fmt: skip
    transcript = run_round(coordinator, fleet({}), inputs(NAMES))
    assert seen == [len(NAMES)] and transcript.result is None and transcript.closes == {}
    assert transcript.aborted is not None and transcript.aborted.stage == Stage.UNMASK.value
    assert transcript.aborted.why == "the round's sum fails admission (a count below zero)"


def test_a_rolled_back_secure_fleet_starts_its_sum_again_from_the_round_it_opens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The database is restored from round 2; the devices answered up to round 5, and
    # rounds 2 to 5 may have added inputs the restored sum lacks. No device's part can be
    # taken out of it: it starts again at round 6, which the announcement says.
    clock = Clock()
    table = SecureAggregation(threshold=2, epsilon=0.0, dataset_size=50)
    cfg = dataclasses.replace(
        config(tmp_path / "s", method="lda", min_clients=2, wait_after_quorum_s=0.0,
               allow_list=tuple(f"dev-{i}" for i in range(3)),
               timeout_s=60.0),
        privacy=PrivacySettings(aggregation="secure"), secure_aggregation=table,
    )  # fmt: skip
    release = secure_release(table, k=DIM, classes=len(CLASSES), gram=True)
    rows = np.random.default_rng(0).normal(size=(6, DIM))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    stats = cf.device_statistics(rows, np.arange(6) % len(CLASSES), num_classes=len(CLASSES))
    total = flatten(stats, gram=True)

    def play(m: RoundManager, rounds: int) -> None:
        for _ in range(rounds):
            assert m.take_secure(SecureOutcome(round=m.round, total=total, survivors=2,
                                               contributors=("dev-0", "dev-1")))  # fmt: skip
            clock.now += 1.0
            assert m.poll() is not None

    m = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=clock)
    play(m, 2)
    backup = tmp_path / "backup.sqlite3"
    assert snapshot(m.store.path, backup) == 2
    play(m, 4)  # rounds 2..5 add to the sum
    assert held_by(m) == ({"dev-0": 5, "dev-1": 5}, 0)
    m.store.close()
    shutil.copy(backup, m.store.path)
    for suffix in ("-wal", "-shm"):
        Path(f"{m.store.path}{suffix}").unlink(missing_ok=True)

    back = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=clock)
    assert back.round == 2 and held_by(back) == ({"dev-0": 1, "dev-1": 1}, 0)
    for i in range(3):
        back.record_status(status(f"dev-{i}", back.run_id, 5))
    with caplog.at_level(logging.WARNING):
        skipped = back.poll()
    assert skipped is not None and skipped.round == 6
    assert skipped.extras[SINCE_EXTRA].tolist() == [6.0]
    assert held_by(back) == ({}, 6)
    assert "the fleet's secure sum may lack inputs of the rounds the database lost" in caplog.text
    # What a restart reads: the sum started again, not the restored one.
    assert release.settings is not None
    kept = FleetSum.load(Store(cfg.database).meta_value(SUM_KEY), release=release)
    assert (kept.devices, kept.held, kept.since) == (0, {}, 6)
    # The devices add all of their statistics again, and the sum holds them once.
    play(back, 1)
    assert held_by(back) == ({"dev-0": 6, "dev-1": 6}, 6)
