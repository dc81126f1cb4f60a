"""A simulated fleet's CA: what ``systemd/make-certs.sh`` is to a deployed fleet, for the
Ed25519 keys a simulated fleet signs with (:func:`fleet.transports.configs.fleet_keys`).

Secure aggregation in a signed fleet needs it: each device's certificate binds its id to
its signing key, so its neighbours take its advertised keys as its own, not on the
coordinator's word (secagg/enrolled.py). The CA's key lies beside the others under the
run's ``keys/``, which a simulation can afford; a deployment keeps it with the operator
(docs/deploy.md).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

from runtime.files import atomic_write

#: How long a simulated fleet's certificates last: far past any run, and resumed runs.
VALID = datetime.timedelta(days=3650)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


Validity = tuple[datetime.datetime, datetime.datetime]


def ca_certificate(
    key: ed25519.Ed25519PrivateKey, *, name: str, valid: Validity
) -> x509.Certificate:
    """A self-signed CA certificate for ``key``, named ``name``, valid from ``valid[0]`` to
    ``valid[1]``; it may issue device certificates only (path length 0)."""
    return (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, None)
    )


def device_certificate(
    key: ed25519.Ed25519PrivateKey, ca: x509.Certificate, *, cn: str,
    public: ed25519.Ed25519PublicKey, valid: Validity,
) -> x509.Certificate:  # fmt: skip
    """The certificate CA ``ca`` (whose key is ``key``) issues device ``cn`` for its signing
    key ``public``: the binding a device's neighbours check (secagg/enrolled.py)."""
    return (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, None)
    )


def _ca(key_path: Path, cert_path: Path) -> tuple[ed25519.Ed25519PrivateKey, x509.Certificate]:
    """The CA's key and certificate, made if missing."""
    if key_path.exists() and cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ed25519.Ed25519PrivateKey)
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = ed25519.Ed25519PrivateKey.generate()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = ca_certificate(key, name="ProtoFleet simulated fleet CA",
                          valid=(now - datetime.timedelta(days=1), now + 2 * VALID))  # fmt: skip
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    atomic_write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def issue_certificates(
    *, ca_key: Path, ca_cert: Path, devices: dict[str, tuple[Path, Path]]
) -> None:
    """Make the CA if missing, then a certificate for each device lacking one:
    ``devices`` maps its id to (its public key file, the certificate file to write)."""
    key, ca = _ca(ca_key, ca_cert)
    now = datetime.datetime.now(datetime.timezone.utc)
    for name, (public, out) in devices.items():
        if out.exists():
            continue
        device_key = serialization.load_pem_public_key(public.read_bytes())
        assert isinstance(device_key, ed25519.Ed25519PublicKey)
        cert = device_certificate(key, ca, cn=name, public=device_key,
                                  valid=(now - datetime.timedelta(days=1), now + VALID))  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, cert.public_bytes(serialization.Encoding.PEM))
