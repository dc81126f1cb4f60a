"""A fleet CA for tests, in memory: an Ed25519 CA that issues each device a certificate
for its Ed25519 signing key with its id as CN, as systemd/make-certs.sh does with EC
P-256 keys (tests/test_secagg_enrolled.py checks one of make-certs.sh's too)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fleet.transports.fleet_ca import ca_certificate, device_certificate
from protocol.auth import Signer
from secagg.enrolled import Enrolment

NOW = datetime.datetime(2026, 11, 28, tzinfo=datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


@dataclass
class TestCA:
    """A CA named ``name``; :meth:`enrol` issues a device its key and certificate."""

    __test__ = False  # not a test class, whatever pytest makes of the name

    name: str = "ProtoFleet fleet CA"
    key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)

    def __post_init__(self) -> None:
        self.certificate = ca_certificate(self.key, name=self.name,
                                          valid=(NOW - 365 * DAY, NOW + 365 * DAY))  # fmt: skip

    def issue(
        self, cn: str, key: Ed25519PrivateKey, *, valid: tuple[datetime.datetime, ...] = ()
    ) -> bytes:
        """A certificate (DER) binding ``cn`` to ``key``'s public key."""
        start, end = valid or (NOW - DAY, NOW + 30 * DAY)
        cert = device_certificate(self.key, self.certificate, cn=cn, public=key.public_key(),
                                  valid=(start, end))  # fmt: skip
        return cert.public_bytes(serialization.Encoding.DER)

    def enrol(self, client: str, *, run: str) -> Enrolment:
        """``client``'s enrolment under this CA: a fresh key, its certificate, this CA."""
        key = Ed25519PrivateKey.generate()
        return Enrolment(
            client=client, signer=Signer(key), certificate=self.issue(client, key),
            ca=self.certificate, run=run, clock=NOW,
        )  # fmt: skip
