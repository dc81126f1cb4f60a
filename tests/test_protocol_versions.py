"""Versions that overlap (docs/protocol.md, "Versions"): this code reads version 2 as well
as its own 3, writes a message back in the version it came in, and refuses any other
version with the version named; the coordinator counts a version-2 device's update and
answers it in version 2, until its ``[protocol] previous_until``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from coordinator.config import ProtocolSettings
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import Store
from protocol import (
    Message,
    PrototypeUpdate,
    RoundAnnouncement,
    Status,
    UnsupportedVersion,
)
from protocol.auth import Auth
from protocol.limits import PROTOCOL_VERSION, SUPPORTED_VERSIONS
from protocol.receipts import Receipt
from tests import factories
from tests.coordinator_helpers import config, stand_in_update

V2 = Path(__file__).parent / "golden" / "v2"
#: The version-2 golden payloads (written by the version-2 encoder, before runs), and the
#: messages they hold as this code builds them in version 2.
V2_CASES: dict[str, tuple[type[Message], Callable[[], Message]]] = {
    "update": (PrototypeUpdate, lambda: factories.update(wire_version=2)),
    "round": (RoundAnnouncement, lambda: factories.announcement(run="", wire_version=2)),
    "status": (Status, lambda: factories.status(run="", wire_version=2)),
}


def test_this_code_reads_its_version_and_the_previous_one():
    assert PROTOCOL_VERSION == 3 and SUPPORTED_VERSIONS == (2, 3)


@pytest.mark.parametrize("name", sorted(V2_CASES))
def test_the_version_2_golden_payloads_are_read_and_written_back_byte_for_byte(name):
    cls, make = V2_CASES[name]
    golden = bytes.fromhex((V2 / f"{name}.hex").read_text())
    decoded = cls.from_wire(golden)
    assert decoded.wire_version == 2
    assert decoded.to_wire() == golden
    assert make().to_wire() == golden


def test_a_version_2_announcement_takes_its_run_from_its_signature_and_dim_from_its_rows():
    golden = bytes.fromhex((V2 / "round.hex").read_text())
    read = RoundAnnouncement.from_wire(golden)
    assert (read.run, read.run_started, read.dim) == ("", 0.0, read.global_prototypes.shape[1])
    auth = Auth(run=factories.RUN, signature=bytes(64))  # read, not checked, here
    signed = dataclasses.replace(factories.announcement(wire_version=2), auth=auth)
    back = RoundAnnouncement.from_wire(signed.to_wire())
    assert back.run == factories.RUN
    assert "run" not in msgpack.unpackb(signed.to_wire())


def test_a_receipt_is_written_in_the_version_of_the_update_it_answers():
    v2 = Receipt(fleet="lab", round=3, run="", client="c", digest="ab" * 32, wire_version=2)
    obj = msgpack.unpackb(v2.to_wire())
    assert obj["v"] == 2 and "run" not in obj
    assert Receipt.from_wire(v2.to_wire()) == v2


def _with_version(payload: bytes, version: object) -> bytes:
    obj = msgpack.unpackb(payload)
    obj["v"] = version
    return bytes(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("version", [1, 4, 99])
@pytest.mark.parametrize("cls", [PrototypeUpdate, RoundAnnouncement, Status, Receipt])
def test_another_version_is_refused_naming_it(cls, version):
    makers: dict[type, Callable[[], Message | Receipt]] = {
        PrototypeUpdate: factories.update,
        RoundAnnouncement: factories.announcement,
        Status: factories.status,
        Receipt: lambda: Receipt(fleet="lab", round=1, run="r1", client="c", digest="ab" * 32),
    }
    message = makers[cls]()
    with pytest.raises(UnsupportedVersion, match=f"version {version} is not supported") as err:
        cls.from_wire(_with_version(message.to_wire(), version))
    assert err.value.version == version and err.value.reason == "version"


def test_a_version_2_status_cannot_name_a_run():
    with pytest.raises(ValueError, match="names no run"):
        factories.status(wire_version=2)


def _manager(tmp_path: Path, *, previous_until: float = 0.0, now: float = 100.0) -> RoundManager:
    cfg = config(tmp_path, min_clients=2, wait_after_quorum_s=0.0)
    cfg = dataclasses.replace(cfg, protocol=ProtocolSettings(previous_until=previous_until))
    return RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=lambda: now)


def test_a_version_2_update_is_counted_beside_a_version_3_one(tmp_path):
    m = _manager(tmp_path)
    old = dataclasses.replace(stand_in_update(0, 0), wire_version=2)
    assert msgpack.unpackb(old.to_wire())["v"] == 2
    decision = m.offer(old.to_wire(), topic_client=old.client)
    assert decision.accepted and decision.wire_version == 2
    assert m.offer(stand_in_update(1, 0).to_wire(), topic_client="dev-1").wire_version == 3
    nxt = m.poll()
    assert nxt is not None and nxt.round == 1
    assert set(nxt.local_sets) == {"dev-0", "dev-1"}  # both counted
    m.store.close()


def test_version_2_is_refused_from_the_date_announced_and_the_date_is_announced(tmp_path):
    m = _manager(tmp_path, previous_until=50.0, now=100.0)
    old = dataclasses.replace(stand_in_update(0, 0), wire_version=2)
    assert m.offer(old.to_wire(), topic_client=old.client).reason == "version"
    assert m.offer(stand_in_update(0, 0).to_wire(), topic_client="dev-0").accepted
    params = m.announcement.params
    assert params["protocol_oldest"] == 2 and params["protocol_oldest_until"] == 50.0
    m.store.close()


def test_announce_version_must_be_one_this_code_reads():
    with pytest.raises(ValueError, match="announce_version must be one of 2, 3"):
        ProtocolSettings(announce_version=4)
