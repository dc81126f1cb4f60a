"""Receipts over a real Mosquitto: the coordinator confirms what it stored, a device sends
its update again until it has that confirmation."""

from __future__ import annotations

import dataclasses
import time

import pytest

from export import bundle as bundle_mod
from protocol import ProtocolError, PrototypeUpdate, TopicKind, parse_topic, update_filter
from protocol.receipts import Receipt, payload_digest
from protocol.topics import receipt_topic
from tests.coordinator_helpers import coordinator_toml, finish, stand_in_update, stand_ins, start
from tests.mqtt_helpers import connected
from tests.process_helpers import agent_process, status
from tests.test_agent_service import StandInCoordinator, write_config

pytestmark = pytest.mark.broker


def receipts_of(inbox, count: int) -> list[Receipt]:
    return [Receipt.from_wire(m.payload) for m in inbox.wait(count)[:count]]


@pytest.mark.slow
def test_an_update_and_its_duplicate_are_answered_with_the_stored_updates_receipt(
    mosquitto, tmp_path
):
    config = coordinator_toml(tmp_path, mosquitto.address.port, clients=2)
    proc = start(config)
    try:
        with (
            connected(mosquitto.address, "dev-0", subscribe=(receipt_topic("lab", "dev-0"),)) as (
                _,
                receipts,
            ),
            stand_ins(mosquitto) as fleet,
        ):
            run = fleet.announcement(0).run
            first = stand_in_update(0, 0)
            fleet.send([first])
            (receipt,) = receipts_of(receipts, 1)
            assert receipt == Receipt(
                fleet="lab", round=0, run=run, client="dev-0",
                digest=payload_digest(first.to_wire()),
            )  # fmt: skip
            fleet.send([first])  # a re-send: answered, not refused silently
            assert receipts_of(receipts, 2)[1] == receipt
            # Another payload for the same device and round: the receipt names what is
            # stored, so the device learns its own update was not taken.
            other = dataclasses.replace(first, counts=(1, 1))
            fleet.send([other])
            assert receipts_of(receipts, 3)[2].digest == receipt.digest
            fleet.send([stand_in_update(1, 0)])
            fleet.announcement(1)
        finish(proc)
    finally:
        proc.kill()
    assert status("edge-coordinator", config)["rejections"] == {"duplicate": 2}


@pytest.mark.slow
def test_an_agent_sends_its_update_again_until_a_receipt_names_it(mosquitto, small_zoo, tmp_path):
    bundle_id = bundle_mod.load(small_zoo).id
    cfg, _ = write_config(
        tmp_path / "a", small_zoo, "dev-a", "clean", mosquitto.address.port, epochs=1
    )
    cfg.write_text(cfg.read_text().replace("[mqtt]\n", "[mqtt]\nresend_s = 0.5\n"))
    with connected(mosquitto.address, "stand-in", subscribe=(update_filter("lab"),)) as (
        pub,
        inbox,
    ):
        # A coordinator whose receipts are lost, as the broker lost its updates in a burst.
        coord = StandInCoordinator(pub, inbox, bundle_id, receipts=False)
        agent = agent_process(cfg)
        try:
            coord.announce(0, [])

            def copies() -> list[bytes]:
                return [
                    bytes(m.payload)
                    for m in inbox.messages
                    if parse_topic(m.topic).kind is TopicKind.UPDATE
                ]

            deadline = time.monotonic() + 90
            while len(copies()) < 3:
                inbox.wait(len(inbox.messages) + 1, timeout=max(0.1, deadline - time.monotonic()))
            assert len(set(copies())) == 1  # the stored update, byte for byte
            seen = agent.wait_for("round 0: no receipt yet; sending the update again")
            coord.receipts = True  # the next copy is answered
            agent.wait_for("round 0: update stored by the coordinator", after=seen)
            assert status("edge-agent", cfg)["pending_round"] is None
            # A round that closes without a receipt ends the re-sending too.
            coord.receipts = False
            coord.announce(1, [PrototypeUpdate.from_wire(copies()[0])])
            seen = agent.wait_for("round 1: no receipt yet; sending the update again")
            coord.announce(2, [])
            agent.wait_for("round 1 closed before the coordinator confirmed this update")
            assert agent.stop() == 0
        finally:
            agent.close()


def test_a_refusal_round_trips_and_a_receipt_keeps_its_bytes():
    # `refused` is on the wire only when set: a receipt's bytes (and so its signature)
    # are what they were before refusals existed.
    digest = "a" * 64
    receipt = Receipt(fleet="lab", round=3, run="r1", client="dev-1", digest=digest)
    assert b"refused" not in receipt.to_wire()
    refusal = Receipt(fleet="lab", round=3, run="r1", client="dev-1", digest=digest,
                      refused="revoked")  # fmt: skip
    back = Receipt.from_wire(refusal.to_wire())
    assert back.refused == "revoked" and back.digest == digest
    with pytest.raises(ProtocolError):
        Receipt(fleet="lab", round=3, run="r1", client="dev-1", digest=digest, refused="busy")
