"""Signed messages: the statement a signature covers, the keys that make one, and a real
coordinator behind a real Mosquitto refusing forged, unenrolled and re-stamped updates
while it accepts the real device's."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from edge_agent.keys import AgentKeys
from protocol import PrototypeUpdate, RoundAnnouncement
from protocol.auth import KeyFileError, Signer, sign, signature_problem
from runtime.keyfiles import generate_ed25519, load_enrolled, load_signer, load_verifier
from runtime.security import AgentSecurity, CoordinatorSecurity
from tests import factories
from tests.coordinator_helpers import (
    BUNDLE,
    coordinator_toml,
    hand_globals,
    stand_in_update,
    stand_ins,
    start,
)
from tests.process_helpers import status

BIN = Path(sys.executable).parent


def ec_key(path: Path) -> None:
    """An EC P-256 key in the SEC1 PEM form ``make-certs.sh`` writes."""
    subprocess.run(
        ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(path)],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    generate_ed25519(root / "coordinator.key", root / "coordinator.pub")
    for name in ("dev-0", "dev-1", "dev-2"):
        generate_ed25519(root / "agents" / f"{name}.key", root / "devices" / f"{name}.pub")
    generate_ed25519(root / "attacker.key", root / "attacker.pub")
    return root


@pytest.mark.parametrize("kind", ["ed25519", "ec"])
def test_a_signature_covers_round_client_run_and_payload(tmp_path, kind):
    path = tmp_path / "device.key"
    if kind == "ed25519":
        generate_ed25519(path, tmp_path / "device.pub")
    else:
        ec_key(path)
    signer = load_signer(path)
    update = sign(factories.update(), signer, run="run-a")
    received = PrototypeUpdate.from_wire(update.to_wire())  # what a coordinator decodes
    assert signature_problem(received, signer.public, run="run-a") is None
    replace = dataclasses.replace
    assert signature_problem(replace(received, round=4), signer.public, run="run-a") == (
        "bad_signature"
    )
    assert signature_problem(replace(received, client="dev-x"), signer.public, run=None) == (
        "bad_signature"
    )
    protos = np.zeros_like(received.prototypes)
    assert signature_problem(replace(received, prototypes=protos), signer.public, run=None) == (
        "bad_signature"
    )
    assert signature_problem(received, signer.public, run="run-b") == "wrong_run"
    assert signature_problem(replace(received, auth=None), signer.public, run=None) == "unsigned"
    assert signature_problem(received, None, run=None) == "unenrolled"


def test_unsigned_messages_keep_their_encoding():
    # Golden bytes (test_protocol_golden.py) hold for every message without a signature.
    update = factories.update()
    assert PrototypeUpdate.from_wire(update.to_wire()).auth is None
    signed = sign(update, load_signer_for_test(), run="r1")
    # A receiver re-encodes what it decoded to check the signature: the same bytes.
    assert PrototypeUpdate.from_wire(signed.to_wire()) == signed
    assert PrototypeUpdate.from_wire(signed.to_wire()).to_wire() == signed.to_wire()
    assert dataclasses.replace(signed, auth=None).to_wire() == update.to_wire()


def load_signer_for_test():
    return Signer(ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32))))


def test_a_device_pins_the_coordinator_key(keys):
    agent = AgentKeys.load(
        AgentSecurity(key=keys / "agents" / "dev-0.key", coordinator=keys / "coordinator.pub")
    )
    coordinator = load_signer(keys / "coordinator.key")
    attacker = load_signer(keys / "attacker.key")
    ann = factories.announcement()
    assert agent.announcement_problem(sign(ann, coordinator, run=ann.run)) is None
    assert agent.announcement_problem(sign(ann, attacker, run=ann.run)) == "bad_signature"
    assert agent.announcement_problem(ann) == "unsigned"
    # Signed by the coordinator, but for another run than the one its body names: the
    # body's run is what a device follows, so the signature must vouch for it.
    assert agent.announcement_problem(sign(ann, coordinator, run="r")) == "wrong_run"
    again = RoundAnnouncement.from_wire(sign(ann, coordinator, run=ann.run).to_wire())
    assert agent.announcement_problem(dataclasses.replace(again, round=2**31 - 1)) == (
        "bad_signature"
    )


def test_key_files_are_checked_with_one_line_naming_the_setting(tmp_path, keys):
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(KeyFileError, match=r"^security.key .*junk.pem: not an unencrypted PEM"):
        load_signer(tmp_path / "junk.pem")
    with pytest.raises(KeyFileError, match="No such file"):
        load_verifier(tmp_path / "none.pub", setting="security.coordinator")
    (keys / "devices" / "README.txt").write_text("enrolled devices")
    ec_key(tmp_path / "ec.key")
    assert sorted(load_enrolled(keys / "devices")) == ["dev-0", "dev-1", "dev-2"]
    with pytest.raises(ValueError, match=r"security.key \(this device's private key\)"):
        AgentSecurity()
    with pytest.raises(ValueError, match=r"security\.devices"):
        CoordinatorSecurity(key=keys / "coordinator.key")


def test_a_coordinator_without_keys_or_with_a_bad_one_says_so_in_one_line(tmp_path, keys):
    base = (
        f'fleet = "lab"\nstate_dir = "{tmp_path / "state"}"\n[model]\nbundle = "{BUNDLE}"\n'
        'classes = ["a", "b", "c"]\ndim = 4\n'
    )
    cases = {
        "": "security.key (the coordinator's private key) and security.devices",
        f'[security]\nkey = "{tmp_path / "none.key"}"\ndevices = "{keys / "devices"}"\n': (
            f"security.key {tmp_path / 'none.key'}: No such file"
        ),
    }
    for n, (section, message) in enumerate(cases.items()):
        config = tmp_path / f"c{n}.toml"
        config.write_text(base + section)
        result = subprocess.run(
            [str(BIN / "edge-coordinator"), "run", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2
        (line,) = result.stderr.strip().splitlines()
        assert message in line, line


@pytest.mark.slow
@pytest.mark.broker
def test_forged_unenrolled_and_restamped_updates_are_rejected_and_the_real_ones_accepted(
    mosquitto, tmp_path, keys
):
    config = coordinator_toml(tmp_path, mosquitto.address.port, rounds=2, keys=keys)
    coordinator_key = load_verifier(keys / "coordinator.pub", setting="test")
    attacker = load_signer(keys / "attacker.key")
    devices = {n: load_signer(keys / "agents" / f"{n}.key") for n in ("dev-0", "dev-1", "dev-2")}
    proc = start(config)
    try:
        with stand_ins(mosquitto) as fleet:
            first = fleet.announcement(0)
            assert signature_problem(first, coordinator_key, run=None) is None
            assert first.auth is not None
            run = first.auth.run
            real = [sign(stand_in_update(i, 0), devices[f"dev-{i}"], run=run) for i in range(3)]
            # Each of these arrives before the device it poses as.
            forged = sign(  # an attacker's own key on dev-0's name, with counts of 1e6
                dataclasses.replace(real[0], auth=None, counts=(1e5, 1e5)), attacker, run=run
            )
            unsigned = dataclasses.replace(real[1], auth=None)
            unenrolled = sign(  # a client id nobody enrolled
                dataclasses.replace(stand_in_update(9, 0), client="dev-9"), attacker, run=run
            )
            fleet.send([forged, unsigned, unenrolled, *real])
            second = fleet.announcement(1)
            assert set(second.local_sets) == {"dev-0", "dev-1", "dev-2"}
            expected = hand_globals([stand_in_update(i, 0) for i in range(3)])
            for row, c in zip(second.global_prototypes, second.global_classes, strict=True):
                np.testing.assert_allclose(row, expected[c], rtol=1e-5, atol=1e-6)
            # Round 1: dev-1's captured round-0 update re-stamped with the new round, and
            # one signed for another coordinator run, come before dev-1's own.
            restamped = dataclasses.replace(real[1], round=1)
            other_run = sign(stand_in_update(1, 1), devices["dev-1"], run="0123456789abcdef")
            real1 = [sign(stand_in_update(i, 1), devices[f"dev-{i}"], run=run) for i in range(3)]
            fleet.send([restamped, other_run, *real1])
            final = fleet.announcement(2)
            assert set(final.local_sets) == {"dev-0", "dev-1", "dev-2"}
            assert signature_problem(final, coordinator_key, run=run) is None
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
    finally:
        proc.kill()
    shown = status("edge-coordinator", config)
    assert shown["security"] == "signed"
    assert shown["rejections"] == {
        "bad_signature": 2,
        "unsigned": 1,
        "unenrolled": 1,
        "wrong_run": 1,
    }
