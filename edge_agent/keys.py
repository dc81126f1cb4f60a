"""The device's keys: its own signing key and the coordinator's pinned public key; for
secure aggregation, the fleet CA it pins and its certificate from it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from protocol.auth import KeyFileError, Signer, Verifier, sign, signature_problem
from runtime.keyfiles import FleetCA, load_certificate, load_signer, load_verifier
from runtime.security import INSECURE_WARNING, AgentSecurity
from secagg.enrolled import Enrolment

if TYPE_CHECKING:
    from cryptography import x509

log = logging.getLogger(__name__)

M = TypeVar("M")


@dataclass(frozen=True)
class AgentKeys:
    signer: Signer | None = None
    coordinator: Verifier | None = None
    #: The fleet CA (security.ca) and this device's certificate from it (DER).
    ca: x509.Certificate | None = None
    certificate: bytes | None = None

    @property
    def insecure(self) -> bool:
        return self.signer is None

    @classmethod
    def load(cls, settings: AgentSecurity, *, client: str | None = None) -> AgentKeys:
        """Raises :class:`~protocol.auth.KeyFileError` naming the setting and file; with
        ``client``, also unless security.certificate is the fleet CA's for that id and
        security.key (its neighbours would refuse every advertisement otherwise)."""
        if settings.insecure:
            log.warning("%s", INSECURE_WARNING)
            return cls()
        assert settings.key is not None and settings.coordinator is not None  # config checks
        keys = cls(
            signer=load_signer(settings.key, setting="security.key"),
            coordinator=load_verifier(settings.coordinator, setting="security.coordinator"),
        )
        if settings.ca is None or settings.certificate is None:
            return keys
        ca = FleetCA.load(settings.ca).certificate
        certificate = load_certificate(settings.certificate, setting="security.certificate")
        keys = cls(signer=keys.signer, coordinator=keys.coordinator, ca=ca, certificate=certificate)
        if client is not None:
            try:
                keys.enrolment(client, run="check")
            except ValueError as exc:
                raise KeyFileError(f"security.certificate {settings.certificate}: {exc}") from exc
        return keys

    def enrolment(self, client: str, *, run: str) -> Enrolment | None:
        """What device ``client`` signs and checks a secure round of ``run`` with; None
        when the fleet runs insecure. Raises ValueError if the certificate is not the
        fleet CA's for ``client`` and this device's key, or there is none in a signed
        fleet (secure aggregation needs it: edge_agent/config.py)."""
        if self.signer is None:
            return None
        if self.ca is None or self.certificate is None:
            raise ValueError("a signed device needs security.ca and security.certificate")
        return Enrolment(client=client, signer=self.signer, certificate=self.certificate,
                         ca=self.ca, run=run)  # fmt: skip

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
