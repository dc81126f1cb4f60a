"""The device's keys: its own signing key and the coordinator's pinned public key."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

from protocol.auth import Signer, Verifier, sign, signature_problem
from runtime.keyfiles import load_signer, load_verifier
from runtime.security import INSECURE_WARNING, AgentSecurity

log = logging.getLogger(__name__)

M = TypeVar("M")


@dataclass(frozen=True)
class AgentKeys:
    signer: Signer | None = None
    coordinator: Verifier | None = None

    @property
    def insecure(self) -> bool:
        return self.signer is None

    @classmethod
    def load(cls, settings: AgentSecurity) -> AgentKeys:
        """Raises :class:`~protocol.auth.KeyFileError` naming the setting and file."""
        if settings.insecure:
            log.warning("%s", INSECURE_WARNING)
            return cls()
        assert settings.key is not None and settings.coordinator is not None  # config checks
        return cls(
            signer=load_signer(settings.key, setting="security.key"),
            coordinator=load_verifier(settings.coordinator, setting="security.coordinator"),
        )

    def announcement_problem(self, message: Any) -> str | None:
        """Why an announcement or receipt is not the pinned coordinator's, if it is not;
        the run its body names must be the run it is signed for."""
        if self.insecure:
            return None
        return signature_problem(message, self.coordinator, run=message.run)

    def sign(self, message: M, *, run: str | None) -> M:
        """``message`` signed for coordinator run ``run`` (as is, when insecure)."""
        if self.signer is None:
            return message
        assert run is not None  # a signed announcement always names its run
        return sign(message, self.signer, run=run)
