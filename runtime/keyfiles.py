"""Key files: a service's own signing key, a pinned public key, a folder of enrolled devices.

PEM files only (Ed25519, or EC P-256 as ``systemd/make-certs.sh`` issues them); every
error names the setting and the file, so a misconfigured service says what to fix.

An enrolment folder holds one file per device, named ``<client id><suffix>``:

- ``.crt``: a PEM certificate (``-----BEGIN CERTIFICATE-----``), its key enrolled;
- ``.pub``: a PEM public key (``-----BEGIN PUBLIC KEY-----``, SubjectPublicKeyInfo);
- ``.pem``: either of the two.

With the fleet's CA (:class:`FleetCA`, ``security.ca``) only certificates it issued
directly to that client id (CN) are enrolled, and those its revocation list
(``security.crl``) revokes are left out: a bare public key proves nothing about who
holds it, so such a fleet refuses one.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.auth import KeyFileError, Signer, Verifier
from protocol.ids import validate_id
from runtime.files import atomic_write

if TYPE_CHECKING:
    from cryptography import x509


def _read(path: Path, setting: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{setting} {path}: {exc.strerror or exc}") from exc


def load_signer(path: Path, *, setting: str = "security.key") -> Signer:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    data = _read(path, setting)
    try:
        return Signer(load_pem_private_key(data, password=None))
    except (ValueError, TypeError) as exc:
        why = str(exc) if isinstance(exc, KeyFileError) else "not an unencrypted PEM private key"
        raise KeyFileError(f"{setting} {path}: {why}") from exc


def _certificate(data: bytes) -> x509.Certificate | None:
    """The PEM certificate in ``data``, None if it holds none; ValueError if damaged."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(data) if b"BEGIN CERTIFICATE" in data else None


def _public(path: Path, *, setting: str) -> tuple[Verifier, x509.Certificate | None]:
    """The key in a PEM public key or certificate file, and the certificate if it is one."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    data = _read(path, setting)
    if b"PRIVATE KEY" in data:
        # Said plainly: it would otherwise read as "not a public key", and a private key
        # belongs with its owner only.
        raise KeyFileError(
            f"{setting} {path}: a private key; give the public key or certificate instead "
            "(a private key stays with its owner)"
        )
    try:
        certificate = _certificate(data)
        if certificate is not None:
            return Verifier(certificate.public_key()), certificate
        return Verifier(load_pem_public_key(data)), None
    except (ValueError, TypeError) as exc:
        why = str(exc) if isinstance(exc, KeyFileError) else "not a PEM public key or certificate"
        raise KeyFileError(f"{setting} {path}: {why}") from exc


def load_certificate(path: Path, *, setting: str) -> bytes:
    """The PEM certificate in ``path``, as DER (how it travels in a secure-aggregation
    advertisement)."""
    from cryptography.hazmat.primitives.serialization import Encoding

    return _pem_certificate(path, setting).public_bytes(Encoding.DER)


def _pem_certificate(path: Path, setting: str) -> x509.Certificate:
    """The PEM certificate in ``path``; :class:`KeyFileError` naming ``setting`` if not one."""
    data = _read(path, setting)
    try:
        certificate = _certificate(data)
    except ValueError as exc:
        raise KeyFileError(f"{setting} {path}: not a PEM certificate") from exc
    if certificate is None:
        raise KeyFileError(f"{setting} {path}: not a PEM certificate")
    return certificate


def load_verifier(path: Path, *, setting: str) -> Verifier:
    """A PEM public key, or the key of a PEM certificate."""
    return _public(path, setting=setting)[0]


@dataclass(frozen=True)
class FleetCA:
    """The fleet's certificate authority (``security.ca``) and, when given, its
    revocation list (``security.crl``: make-certs.sh's ``crl.pem``, the broker's)."""

    certificate: x509.Certificate
    path: Path
    crl: x509.CertificateRevocationList | None = None
    crl_path: Path | None = None

    @classmethod
    def load(cls, ca: Path, crl: Path | None = None, *, setting: str = "security") -> FleetCA:
        """Raises :class:`KeyFileError` naming the setting and the file."""
        from cryptography import x509

        certificate = _pem_certificate(ca, f"{setting}.ca")
        try:
            is_ca = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise KeyFileError(
                f"{setting}.ca {ca}: not a CA certificate (make-certs.sh's ca.crt is the fleet's)"
            )
        if crl is None:
            return cls(certificate=certificate, path=ca)
        raw = _read(crl, f"{setting}.crl")
        try:
            if b"BEGIN X509 CRL" in raw:
                revocations = x509.load_pem_x509_crl(raw)
            else:
                revocations = x509.load_der_x509_crl(raw)
        except ValueError as exc:
            raise KeyFileError(
                f"{setting}.crl {crl}: not a certificate revocation list (PEM or DER)"
            ) from exc
        try:
            # A CA's key can sign; X25519 and the like cannot, and are refused by the check.
            signed = revocations.is_signature_valid(certificate.public_key())  # type: ignore[arg-type]
        except TypeError:
            signed = False
        if revocations.issuer != certificate.subject or not signed:
            raise KeyFileError(f"{setting}.crl {crl}: not issued by {setting}.ca {ca}")
        return cls(certificate=certificate, path=ca, crl=revocations, crl_path=crl)

    def issued(self, certificate: x509.Certificate) -> bool:
        """Whether this CA signed ``certificate`` (make-certs.sh issues directly)."""
        from cryptography.exceptions import InvalidSignature

        try:
            certificate.verify_directly_issued_by(self.certificate)
        except (ValueError, TypeError, InvalidSignature):
            return False
        return True

    def revoked(self, certificate: x509.Certificate) -> bool:
        if self.crl is None:
            return False
        return (
            self.crl.get_revoked_certificate_by_serial_number(certificate.serial_number) is not None
        )

    def crl_expired(self, now: datetime.datetime | None = None) -> bool:
        """A CRL past its next update: Mosquitto then refuses every client."""
        if self.crl is None or self.crl.next_update_utc is None:
            return False
        return (now or datetime.datetime.now(datetime.timezone.utc)) > self.crl.next_update_utc


#: Files of an enrolment folder: ``<client id><suffix>``.
ENROLLED_SUFFIXES = (".pem", ".pub", ".crt")


@dataclass(frozen=True)
class Enrolment:
    """The devices an enrolment folder enrols, and the revoked ones it leaves out."""

    devices: dict[str, Verifier] = field(default_factory=dict)
    #: client id -> its certificate file, revoked by the fleet CA's CRL: not enrolled.
    revoked: dict[str, Path] = field(default_factory=dict)


def enrol(
    folder: Path, *, ca: FleetCA | None = None, setting: str = "security.devices"
) -> Enrolment:
    """Every device key in ``folder``, by client id (the file's stem); with ``ca`` only
    its certificates, checked (module text). Raises :class:`KeyFileError` naming the file
    for one it cannot take."""
    if not folder.is_dir():
        raise KeyFileError(f"{setting} {folder}: not a folder")
    devices: dict[str, Verifier] = {}
    revoked: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix not in ENROLLED_SUFFIXES or not path.is_file():
            continue
        try:
            client = validate_id(path.stem, field=setting)
        except ValueError:
            continue  # not a device's file (a README, a key of another naming)
        if client in devices or client in revoked:
            raise KeyFileError(f"{setting} {folder}: two keys for {client!r}")
        verifier, certificate = _public(path, setting=setting)
        if ca is not None and _revoked(path, certificate, ca=ca, client=client, setting=setting):
            revoked[client] = path
        else:
            devices[client] = verifier
    return Enrolment(devices=devices, revoked=revoked)


def _revoked(
    path: Path, certificate: x509.Certificate | None, *, ca: FleetCA, client: str, setting: str
) -> bool:
    """Whether ``certificate`` (read from ``path``) is revoked; raises unless ``ca`` issued
    it to ``client``."""
    from cryptography import x509

    if certificate is None:
        raise KeyFileError(
            f"{setting} {path}: a bare public key; with security.ca set a device is enrolled "
            f"by the certificate the fleet CA issued it (make-certs.sh's clients/{client}.crt)"
        )
    if not ca.issued(certificate):
        raise KeyFileError(
            f"{setting} {path}: its certificate is not issued by security.ca {ca.path} "
            f"(issuer: {certificate.issuer.rfc4514_string()}); enrol the certificate the "
            "fleet CA issued this device"
        )
    names = certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    cn = str(names[0].value) if names else ""
    if cn != client:
        # The broker knows the device by its CN (use_identity_as_username): a key enrolled
        # under another name would sign updates the broker never lets that device send.
        raise KeyFileError(
            f"{setting} {path}: its certificate is issued to CN={cn!r}, not {client!r}; "
            f"name the file {cn}{path.suffix}"
        )
    return ca.revoked(certificate)


def load_enrolled(folder: Path, *, setting: str = "security.devices") -> dict[str, Verifier]:
    """Every device key in ``folder``, by client id (the file's stem), without a CA."""
    return enrol(folder, setting=setting).devices


def generate_ed25519(private: Path, public: Path) -> None:
    """A fresh Ed25519 key pair as PEM files (private key mode 0600)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    private.parent.mkdir(parents=True, exist_ok=True)
    public.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    atomic_write(
        public,
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )
