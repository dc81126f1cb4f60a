"""The coordinator's keys: its own signing key and the enrolled devices' public keys."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from protocol.auth import Signer, Verifier
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
        log.info("signed messages: %d device(s) enrolled in %s", len(devices), settings.devices)
        return cls(signer=signer, devices=devices)
