"""Neighbours' keys bound to enrolled devices by the fleet CA (secagg/enrolled.py, issue
51): what a device takes as a neighbour's signed advertisement, each reason it refuses
one, a device's own certificate checked before it joins, and make-certs.sh's P-256
certificates working as they come. The attacks themselves (a coordinator substituting
keys or inventing ids) are in tests/test_secagg_adversary.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.keys import AgentKeys
from protocol.auth import KeyFileError, Signer, sign
from runtime.keyfiles import FleetCA, load_certificate, load_signer
from runtime.security import AgentSecurity
from secagg.enrolled import Enrolment
from secagg.messages import Advertise, PublicKeys, Roster
from tests.fleet_ca import DAY, NOW, TestCA
from tests.test_deploy import SYSTEMD, sh

FLEET, ROUND, RUN = "lab", 5, "run-1"
CA = TestCA()
KEYS = PublicKeys(c=bytes(range(32)), s=bytes(range(1, 33)))


def advert(client: str = "dev-01", **fields: object) -> Advertise:
    base = Advertise(fleet=FLEET, round=ROUND, client=client, keys=KEYS, table=bytes(32),
                     commitment=bytes(range(32)))  # fmt: skip
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def signed(message: Advertise, key: Ed25519PrivateKey, *, run: str = RUN) -> bytes:
    return sign(message, Signer(key), run=run).to_wire()


def problem(
    payload: bytes | None, *, client: str = "dev-01", keys: PublicKeys = KEYS
) -> str | None:
    checker = CA.enrol("dev-00", run=RUN)
    taken = checker.vouched(payload, client=client, fleet=FLEET, round=ROUND, keys=keys)
    if isinstance(taken, str):
        return taken
    assert taken.to_wire() == payload and taken.client == client  # the advertisement itself
    return None


def test_a_neighbours_own_signed_advertisement_is_taken() -> None:
    key = Ed25519PrivateKey.generate()
    assert problem(signed(advert(certificate=CA.issue("dev-01", key)), key)) is None


def test_each_forgery_of_a_neighbours_advertisement_is_refused_with_its_reason() -> None:
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    mine = CA.issue("dev-01", key)
    cases = {
        "is not relayed": None,
        "does not decode (malformed)": b"\x93\x01\x02",
        "carries no certificate": signed(advert(), key),
        "carries a certificate that does not parse": signed(advert(certificate=b"x" * 40), key),
        "carries a certificate the fleet CA did not issue": signed(
            advert(certificate=TestCA().issue("dev-01", key)), key
        ),
        "carries a certificate issued to another device": signed(
            advert(certificate=CA.issue("dev-02", key)), key
        ),
        "carries a certificate outside its validity": signed(
            advert(certificate=CA.issue("dev-01", key, valid=(NOW - 30 * DAY, NOW - DAY))), key
        ),
        "is not signed by its enrolled key (bad_signature)": signed(
            advert(certificate=mine), other
        ),
        "is not signed by its enrolled key (wrong_run)": signed(
            advert(certificate=mine), key, run="run-0"
        ),
        "is not signed by its enrolled key (unsigned)": advert(certificate=mine).to_wire(),
        "is another device's or another round's": signed(
            advert(certificate=mine, round=ROUND + 1), key
        ),
        "is for other keys than the roster's": signed(
            advert(certificate=mine, keys=PublicKeys(c=KEYS.s, s=KEYS.c)), key
        ),
    }
    assert {why: problem(payload) for why, payload in cases.items()} == {w: w for w in cases}


def test_a_device_refuses_to_join_with_a_certificate_that_is_not_its_own() -> None:
    key = Ed25519PrivateKey.generate()
    enrol = dict(signer=Signer(key), ca=CA.certificate, run=RUN, clock=NOW)
    with pytest.raises(ValueError, match="issued to another device"):
        Enrolment(client="dev-00", certificate=CA.issue("dev-01", key), **enrol)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fleet CA did not issue"):
        Enrolment(client="dev-00", certificate=TestCA().issue("dev-00", key), **enrol)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not for its signing key"):
        other = Ed25519PrivateKey.generate()
        Enrolment(client="dev-00", certificate=CA.issue("dev-00", other), **enrol)  # type: ignore[arg-type]


def test_advertisements_and_rosters_carry_certificates_and_signed_adverts_on_the_wire() -> None:
    # An insecure fleet's messages keep the encoding they had (no empty fields).
    plain = advert()
    assert b"certificate" not in plain.to_wire()
    assert Advertise.from_wire(plain.to_wire()).certificate == b""
    key = Ed25519PrivateKey.generate()
    certificate = CA.issue("dev-01", key)
    payload = signed(advert(certificate=certificate), key)
    back = Advertise.from_wire(payload)
    assert back.certificate == certificate
    assert back.auth is not None and back.to_wire() == payload
    mine = PublicKeys(c=bytes(range(2, 34)), s=bytes(range(3, 35)))
    roster = Roster(fleet=FLEET, round=ROUND, client="dev-00", clients=("dev-00", "dev-01"),
                    keys={"dev-00": mine, "dev-01": KEYS}, adverts={"dev-01": payload})  # fmt: skip
    assert Roster.from_wire(roster.to_wire()).adverts == {"dev-01": payload}
    assert b"adverts" not in dataclasses.replace(roster, adverts={}).to_wire()
    with pytest.raises(ValueError, match="dev-02 has no keys in the roster"):
        dataclasses.replace(roster, adverts={"dev-02": payload})


def test_make_certs_p256_certificates_enrol_a_device_and_vouch_for_it(tmp_path: Path) -> None:
    out = tmp_path / "fleet"
    sh(str(SYSTEMD / "make-certs.sh"), "--out", str(out), "dev-0", "dev-1")
    ca = FleetCA.load(out / "ca.crt").certificate

    def enrolment(name: str) -> Enrolment:
        cert = load_certificate(out / "clients" / f"{name}.crt", setting="security.certificate")
        signer = load_signer(out / "clients" / f"{name}.key")
        return Enrolment(client=name, signer=signer, certificate=cert, ca=ca, run=RUN)

    sender = enrolment("dev-1")
    payload = sender.sign(advert("dev-1")).to_wire()
    checker = enrolment("dev-0")
    taken = checker.vouched(payload, client="dev-1", fleet=FLEET, round=ROUND, keys=KEYS)
    assert not isinstance(taken, str) and taken.certificate == sender.certificate
    # The agent's configuration: its key, its certificate and the CA, checked at start.
    security = AgentSecurity(key=out / "clients" / "dev-0.key", coordinator=out / "ca.crt",
                             ca=out / "ca.crt", certificate=out / "clients" / "dev-0.crt")  # fmt: skip
    keys = AgentKeys.load(security, client="dev-0")
    assert keys.enrolment("dev-0", run=RUN) is not None
    wrong = dataclasses.replace(security, certificate=out / "clients" / "dev-1.crt")
    with pytest.raises(KeyFileError, match=r"security\.certificate .*dev-1\.crt: .*another device"):
        AgentKeys.load(wrong, client="dev-0")
