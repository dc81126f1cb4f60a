"""The coordinator's keys: its own signing key and the enrolled devices' public keys, with
the devices the fleet CA's revocation list took out."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from protocol import PrototypeUpdate
from protocol.auth import KeyFileError, Signer, Verifier, signature_problem
from runtime.keyfiles import FleetCA, enrol, load_signer
from runtime.security import INSECURE_WARNING, CoordinatorSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorKeys:
    signer: Signer | None = None
    devices: Mapping[str, Verifier] = field(default_factory=dict)
    #: Devices whose certificate in security.devices the CRL revokes: not enrolled, and
    #: their updates are rejected as ``revoked`` rather than as ``unenrolled``.
    revoked: frozenset[str] = frozenset()

    @property
    def insecure(self) -> bool:
        return self.signer is None

    @classmethod
    def load(cls, settings: CoordinatorSecurity) -> CoordinatorKeys:
        """Raises :class:`~protocol.auth.KeyFileError` naming the setting and file."""
        if settings.insecure:
            log.warning("%s", INSECURE_WARNING)
            return cls()
        assert settings.key is not None and settings.devices is not None  # checked in config
        signer = load_signer(settings.key, setting="security.key")
        ca = FleetCA.load(settings.ca, settings.crl) if settings.ca is not None else None
        if ca is not None and ca.crl_expired():
            log.warning(
                "security.crl %s is past its next update: Mosquitto refuses every client with "
                "it; rerun make-certs.sh (any run rewrites crl.pem) and reload both",
                settings.crl,
            )
        enrolment = enrol(settings.devices, ca=ca, setting="security.devices")
        for client, path in sorted(enrolment.revoked.items()):
            log.warning(
                "not enrolling %s: its certificate %s is revoked by security.crl %s; its "
                "updates are rejected as revoked",
                client,
                path,
                settings.crl,
                extra={"event": "device_revoked", "client": client},
            )
        devices = enrolment.devices
        if not devices:
            # Every update would be refused as unenrolled: a fleet that can never close
            # a round, which the operator would only learn from an idle dashboard.
            raise KeyFileError(
                f"security.devices {settings.devices}: no device is enrolled (no "
                "<client-id>.pem, .pub or .crt file"
                + (", or every certificate is revoked" if enrolment.revoked else "")
                + "), so every update would be refused as unenrolled and no round could "
                "close; enrol each device's public key there (docs/deploy.md), or set "
                "security.insecure = true for a trial"
            )
        log.info(
            "signed messages: %d device(s) enrolled in %s%s",
            len(devices),
            settings.devices,
            f" (certificates of the fleet CA {settings.ca})" if ca is not None else "",
        )
        return cls(signer=signer, devices=devices, revoked=frozenset(enrolment.revoked))

    def signature_problem(self, update: PrototypeUpdate, *, run: str | None) -> str | None:
        """Why ``update`` is not signed by its enrolled device for coordinator run ``run``,
        if it is not: the reasons of :func:`protocol.auth.signature_problem`, and
        ``revoked`` for a signed update of a device the fleet CA's CRL took out."""
        if update.client in self.revoked and update.auth is not None:
            return "revoked"
        return signature_problem(update, self.devices.get(update.client), run=run)

    def quorum_problem(self, min_clients: int) -> str | None:
        """Why ``rounds.min_clients`` cannot be met by the enrolled devices, if it cannot:
        the rounds would then close only by the deadline's floor, every time."""
        if self.insecure or min_clients <= len(self.devices):
            return None
        return (
            f"rounds.min_clients = {min_clients} exceeds the {len(self.devices)} device(s) "
            "enrolled in security.devices: no round reaches its quorum, each closes only "
            "after every deadline extension (rounds.floor); enrol more devices or lower "
            "min_clients"
        )
