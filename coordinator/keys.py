"""The coordinator's keys: its own signing key and the enrolled devices' public keys."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from protocol.auth import KeyFileError, Signer, Verifier
from runtime.keyfiles import load_enrolled, load_signer
from runtime.security import INSECURE_WARNING, CoordinatorSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorKeys:
    signer: Signer | None = None
    devices: Mapping[str, Verifier] = field(default_factory=dict)

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
        devices = load_enrolled(settings.devices, setting="security.devices")
        if not devices:
            # Every update would be refused as unenrolled: a fleet that can never close
            # a round, which the operator would only learn from an idle dashboard.
            raise KeyFileError(
                f"security.devices {settings.devices}: no device is enrolled (no "
                "<client-id>.pem, .pub or .crt file), so every update would be refused as "
                "unenrolled and no round could close; enrol each device's public key there "
                "(docs/deploy.md), or set security.insecure = true for a trial"
            )
        log.info("signed messages: %d device(s) enrolled in %s", len(devices), settings.devices)
        return cls(signer=signer, devices=devices)

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
