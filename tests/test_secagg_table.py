"""One ``[secure_aggregation]`` table for all (issue 51): every advertisement carries its
digest and the coordinator excludes a device whose digest is not its own, telling it why;
a secure fleet's devices refuse the PRV accountant; and FedProto's secure sum announces
no class fewer than ``t`` devices hold."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.rounds import RoundManager
from coordinator.rounds.secure import SecureOutcome
from coordinator.storage.store import Store
from edge_agent.privacy.settings import PrivacySettings
from fleet.transports.secure import coordinator_tables
from runtime.settings import build
from secagg.errors import Excluded
from secagg.fleet import (
    SHARED_FIELDS,
    SecureAggregation,
    flatten_prototypes,
    global_prototypes,
    prototype_release,
)
from secagg.messages import Advertise
from secagg.server import SecAggServer
from tests.secagg_harness import FLEET, ROUND, Coordinator, clients, devices, inputs, run_round

TABLE = SecureAggregation(threshold=3, epsilon=0.0, dataset_size=50)
NAMES = clients(8)


@pytest.mark.parametrize("name", list(SHARED_FIELDS))
def test_the_digest_changes_with_every_shared_field(name: str) -> None:
    value = getattr(TABLE, name)
    other = {"bits": 64, "delta": 1e-6, "epsilon": 2.0, "scale": 1024.0}.get(name, value + 1)
    assert dataclasses.replace(TABLE, **{name: other}).digest() != TABLE.digest()


def test_the_digest_reads_equal_values_alike_and_leaves_the_deadline_out() -> None:
    assert len(TABLE.digest()) == 32
    assert dataclasses.replace(TABLE, epsilon=0).digest() == TABLE.digest()
    assert dataclasses.replace(TABLE, scale=32768).digest() == TABLE.digest()
    # The stage deadline is the coordinator's own: a device need not know it.
    assert dataclasses.replace(TABLE, stage_timeout_s=5.0).digest() == TABLE.digest()


def test_the_digest_is_the_one_docs_protocol_md_spells_out() -> None:
    lines = (
        "threshold=3\nneighbours=0\ncolluding=0\nscale=0x1.0000000000000p+15\nbits=32\n"
        f"epsilon=0x0.0p+0\ndelta={(1e-5).hex()}\ndataset_size=50"
    )
    assert (
        TABLE.digest() == hashlib.sha256(b"protofleet/secagg/table/v1\n" + lines.encode()).digest()
    )


def test_the_settings_of_a_release_carry_the_tables_digest() -> None:
    release = prototype_release(TABLE, dim=4, classes=3)
    assert release.settings.table == TABLE.digest()


def test_a_device_of_another_table_is_excluded_and_the_round_goes_on() -> None:
    # dev-03 reads colluding = 1: it would add less noise than the plan counts on.
    mine = prototype_release(TABLE, dim=2, classes=2).settings
    theirs = prototype_release(dataclasses.replace(TABLE, colluding=1), dim=2, classes=2)
    fleet = devices(mine, NAMES)
    fleet[3] = devices(theirs.settings, NAMES)[3]
    coordinator = Coordinator(settings=mine)
    transcript = run_round(coordinator, fleet, inputs(NAMES))
    excluded = coordinator.refused["dev-03"]
    assert isinstance(excluded, Excluded)
    ours, other = mine.table.hex()[:8], theirs.settings.table.hex()[:8]
    assert excluded.why == (
        f"its [secure_aggregation] table differs from the coordinator's (digest {other}, "
        f"not {ours})"
    )
    assert transcript.result is not None
    assert transcript.result.survivors == tuple(c for c in NAMES if c != "dev-03")


def test_an_advertisement_without_a_digest_decodes_and_is_excluded() -> None:
    # An agent from before the digest: its advertisement has no "table" field.
    settings = prototype_release(TABLE, dim=2, classes=2).settings
    honest = devices(settings, NAMES[:1])[0].advertise()
    body = msgpack.unpackb(honest.to_wire(), raw=False)
    del body["table"]
    older = Advertise.from_wire(msgpack.packb(body, use_bin_type=True))
    assert older.table == b""
    server = SecAggServer(fleet=FLEET, round=ROUND, settings=settings)
    with pytest.raises(Excluded, match=r"differs from the coordinator's \(digest none, not"):
        server.take_advertise(older)


def test_a_secure_fleet_refuses_the_prv_accountant_in_one_line() -> None:
    with pytest.raises(ValueError, match='proven for RDP only: set accountant = "rdp"') as info:
        PrivacySettings(aggregation="secure", accountant="prv")
    assert "\n" not in str(info.value)
    PrivacySettings(aggregation="plain", accountant="prv")
    PrivacySettings(aggregation="secure", accountant="rdp")


# FedProto: a class fewer than t devices hold is not announced.

DIM, CLASSES = 3, 3


def _holders(held: list[list[bool]]) -> np.ndarray:
    """The exact sum of devices holding ``held[i]`` (rows of 0.1 * (class + 1))."""
    rows = np.array([[0.1 * (c + 1)] * DIM for c in range(CLASSES)])
    return np.sum([flatten_prototypes(rows, np.array(h)) for h in held], axis=0)


def test_global_prototypes_drop_a_class_fewer_than_t_devices_hold() -> None:
    # class 0: three holders; class 1: two; class 2: one.
    held = [[True, True, True], [True, True, False], [True, False, False]]
    rows, has = global_prototypes(_holders(held), dim=DIM, classes=CLASSES, threshold=3)
    assert has.tolist() == [True, False, False]
    np.testing.assert_allclose(rows[0], [0.1] * DIM)
    _, has = global_prototypes(_holders(held), dim=DIM, classes=CLASSES, threshold=2)
    assert has.tolist() == [True, True, False]


def test_a_secure_fedproto_coordinator_announces_no_class_fewer_than_t_hold(tmp_path) -> None:
    config = build(CoordinatorConfig, {
        "fleet": FLEET, "state_dir": str(tmp_path / "coordinator"),
        "model": {"method": "fedproto", "bundle": "b", "dim": DIM,
                  "classes": [str(c) for c in range(CLASSES)]},
        "security": {"insecure": True}, **coordinator_tables(TABLE, method="fedproto"),
    })  # fmt: skip
    manager = RoundManager(config=config, store=Store(config.database))
    # Of three devices (t = 3), two hold class 1 and one class 2: its sum would be that
    # device's own prototype, announced to the fleet.
    held = [[True, True, True], [True, True, False], [True, False, False]]
    assert manager.take_secure(SecureOutcome(round=0, total=_holders(held), survivors=3))
    announced = manager.poll()
    assert announced is not None
    assert announced.global_classes == (0,)
    np.testing.assert_allclose(announced.global_prototypes, [[0.1] * DIM], atol=1e-3)
    manager.store.close()
