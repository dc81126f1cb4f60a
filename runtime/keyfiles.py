"""Key files: a service's own signing key, a pinned public key, a folder of enrolled devices.

PEM files only (Ed25519, or EC P-256 as ``systemd/make-certs.sh`` issues them); every
error names the setting and the file, so a misconfigured service says what to fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from protocol.auth import KeyFileError, Signer, Verifier
from protocol.ids import validate_id
from runtime.files import atomic_write


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


def load_verifier(path: Path, *, setting: str) -> Verifier:
    """A PEM public key, or the key of a PEM certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    data = _read(path, setting)
    try:
        if b"BEGIN CERTIFICATE" in data:
            return Verifier(x509.load_pem_x509_certificate(data).public_key())
        return Verifier(load_pem_public_key(data))
    except (ValueError, TypeError) as exc:
        why = str(exc) if isinstance(exc, KeyFileError) else "not a PEM public key or certificate"
        raise KeyFileError(f"{setting} {path}: {why}") from exc


#: Files of an enrolment folder: ``<client id><suffix>``.
ENROLLED_SUFFIXES = (".pem", ".pub", ".crt")


def load_enrolled(folder: Path, *, setting: str = "security.devices") -> dict[str, Verifier]:
    """Every device key in ``folder``, by client id (the file's stem)."""
    if not folder.is_dir():
        raise KeyFileError(f"{setting} {folder}: not a folder")
    keys: dict[str, Verifier] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix not in ENROLLED_SUFFIXES or not path.is_file():
            continue
        try:
            client = validate_id(path.stem, field=setting)
        except ValueError:
            continue  # not a device's file (a README, a key of another naming)
        if client in keys:
            raise KeyFileError(f"{setting} {folder}: two keys for {client!r}")
        keys[client] = load_verifier(path, setting=setting)
    return keys


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
