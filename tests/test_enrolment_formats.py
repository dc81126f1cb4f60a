"""What the coordinator enrols from security.devices: the file formats it takes, and with
the fleet CA (security.ca) only that CA's certificates, issued to the file's client id,
leaving out those its revocation list (security.crl) revokes. Certificates come from
systemd/make-certs.sh, as a fleet's do."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import shutil
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from coordinator.keys import CoordinatorKeys
from protocol.auth import KeyFileError, sign
from runtime.keyfiles import FleetCA, enrol, load_signer
from runtime.security import CoordinatorSecurity
from tests.coordinator_helpers import stand_in_update
from tests.test_deploy import SYSTEMD, sh


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-certs.sh's output: dev-0..dev-2 and the coordinator, dev-2 revoked; beside it
    another CA's dev-0."""
    root = tmp_path_factory.mktemp("enrolment")
    out = root / "fleet"
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(out), "coordinator", "dev-0", "dev-1", "dev-2")
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(out), "--revoke", "dev-2")
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(root / "other"), "dev-0")
    return out


def folder(tmp_path: Path, fleet: Path, *names: str) -> Path:
    """A devices folder with make-certs.sh's certificates of ``names``."""
    devices = tmp_path / "devices"
    devices.mkdir()
    for name in names:
        shutil.copy(fleet / "clients" / f"{name}.crt", devices)
    return devices


def settings(fleet: Path, devices: Path, *, crl: bool = True) -> CoordinatorSecurity:
    return CoordinatorSecurity(
        key=fleet / "clients" / "coordinator.key",
        devices=devices,
        ca=fleet / "ca.crt",
        crl=fleet / "crl.pem" if crl else None,
    )


def public_pem(cert: Path) -> bytes:
    key = x509.load_pem_x509_certificate(cert.read_bytes()).public_key()
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def self_signed(cn: str) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_without_a_ca_certificates_and_public_keys_of_each_format_are_enrolled(tmp_path, fleet):
    devices = folder(tmp_path, fleet, "dev-0")  # .crt: a certificate
    (devices / "dev-1.pub").write_bytes(public_pem(fleet / "clients" / "dev-1.crt"))
    (devices / "dev-2.pem").write_bytes((fleet / "clients" / "dev-2.crt").read_bytes())
    (devices / "dev-3.pem").write_bytes(public_pem(fleet / "clients" / "dev-0.crt"))
    (devices / "dev-4.pem").write_bytes(self_signed("dev-4"))
    (devices / "notes.txt").write_text("not a device")
    keys = CoordinatorKeys.load(dataclasses.replace(settings(fleet, devices), ca=None, crl=None))
    # No CA, no chain to check and no CRL: dev-2's revoked certificate is a key like any.
    assert sorted(keys.devices) == ["dev-0", "dev-1", "dev-2", "dev-3", "dev-4"]
    assert keys.revoked == frozenset()


def test_with_the_fleet_ca_its_certificates_are_enrolled_and_revoked_ones_named(
    tmp_path, fleet, caplog
):
    devices = folder(tmp_path, fleet, "dev-0", "dev-1", "dev-2")
    with caplog.at_level(logging.WARNING, logger="coordinator.keys"):
        keys = CoordinatorKeys.load(settings(fleet, devices))
    assert sorted(keys.devices) == ["dev-0", "dev-1"]
    assert keys.revoked == frozenset({"dev-2"})
    assert [r.getMessage() for r in caplog.records] == [
        f"not enrolling dev-2: its certificate {devices / 'dev-2.crt'} is revoked by "
        f"security.crl {fleet / 'crl.pem'}; its updates are rejected as revoked"
    ]
    why = keys.quorum_problem(3)
    assert why is not None and "min_clients = 3 exceeds the 2 device(s)" in why
    # Its signed updates are rejected as revoked; an unknown device's as unenrolled.
    revoked = sign(stand_in_update(2, 0), load_signer(fleet / "clients" / "dev-2.key"), run="r")
    assert keys.signature_problem(revoked, run="r") == "revoked"
    stranger = dataclasses.replace(revoked, client="dev-9")
    assert keys.signature_problem(stranger, run="r") == "unenrolled"
    own = sign(stand_in_update(0, 0), load_signer(fleet / "clients" / "dev-0.key"), run="r")
    assert keys.signature_problem(own, run="r") is None
    # Without the CRL the same certificate is enrolled.
    assert "dev-2" in CoordinatorKeys.load(settings(fleet, devices, crl=False)).devices


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "dev-1.pub",
            lambda fleet: public_pem(fleet / "clients" / "dev-1.crt"),
            "a bare public key; with security.ca set a device is enrolled by the "
            "certificate the fleet CA issued it (make-certs.sh's clients/dev-1.crt)",
        ),
        (
            "dev-1.crt",
            lambda fleet: self_signed("dev-1"),
            "its certificate is not issued by security.ca {ca} (issuer: CN=dev-1)",
        ),
        (
            "dev-1.crt",
            lambda fleet: (fleet.parent / "other" / "clients" / "dev-0.crt").read_bytes(),
            "its certificate is not issued by security.ca {ca} (issuer: CN=ProtoFleet fleet CA)",
        ),
        (
            "dev-1.crt",  # dev-0's certificate under dev-1's name
            lambda fleet: (fleet / "clients" / "dev-0.crt").read_bytes(),
            "its certificate is issued to CN='dev-0', not 'dev-1'; name the file dev-0.crt",
        ),
        (
            "dev-1.pem",
            lambda fleet: (fleet / "clients" / "dev-1.key").read_bytes(),
            "a private key; give the public key or certificate instead",
        ),
    ],
)
def test_with_the_fleet_ca_anything_else_stops_the_start_naming_the_file(
    tmp_path, fleet, name, content, message
):
    devices = folder(tmp_path, fleet, "dev-0")
    (devices / name).write_bytes(content(fleet))
    expected = f"security.devices {devices / name}: " + message.format(ca=fleet / "ca.crt")
    with pytest.raises(KeyFileError) as raised:
        CoordinatorKeys.load(settings(fleet, devices))
    assert str(raised.value).startswith(expected), str(raised.value)


def test_the_ca_and_crl_settings_are_checked_with_a_line_naming_the_file(tmp_path, fleet):
    devices = folder(tmp_path, fleet, "dev-2")
    with pytest.raises(KeyFileError, match=r"no device is enrolled .*or every certificate is"):
        CoordinatorKeys.load(settings(fleet, devices))  # dev-2 alone, and revoked
    with pytest.raises(ValueError, match=r"security\.crl needs security\.ca"):
        CoordinatorSecurity(key=tmp_path / "k", devices=devices, crl=fleet / "crl.pem")
    other = fleet.parent / "other"
    with pytest.raises(KeyFileError, match=rf"security\.crl {other}/crl\.pem: not issued by"):
        FleetCA.load(fleet / "ca.crt", other / "crl.pem")
    with pytest.raises(KeyFileError, match=r"security\.ca .*dev-0\.crt: not a CA certificate"):
        FleetCA.load(fleet / "clients" / "dev-0.crt")
    with pytest.raises(KeyFileError, match=r"security\.crl .*ca\.crt: not a certificate rev"):
        FleetCA.load(fleet / "ca.crt", fleet / "ca.crt")
    with pytest.raises(KeyFileError, match=r"security\.ca .*missing\.crt: No such file"):
        FleetCA.load(tmp_path / "missing.crt")
    # An expired CRL: the coordinator says so (the broker refuses every client with it).
    ca = FleetCA.load(fleet / "ca.crt", fleet / "crl.pem")
    assert not ca.crl_expired()
    assert ca.crl_expired(
        datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=31)
    )
    assert sorted(enrol(devices, ca=ca).devices) == [] and enrol(devices, ca=ca).revoked
    assert sorted(enrol(devices).devices) == ["dev-2"]  # no CA: a key like any
