"""The ``[security]`` sections of the agent's and the coordinator's configurations.

Signed messages are the default: a configuration without keys is refused unless it says
``insecure = true``, and a service running that way says so in its log and status.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

INSECURE_WARNING = (
    "security.insecure = true: messages are neither signed nor checked; any client that "
    "can publish on the fleet's topics can pose as a device or as the coordinator"
)


@dataclass(frozen=True)
class AgentSecurity:
    """What a device signs with and takes from the round topic.

    ``key``: this device's private key (PEM: Ed25519, or the EC P-256 key make-certs.sh
    issues for its TLS certificate). ``coordinator``: the coordinator's public key or
    certificate, pinned: announcements and receipts signed by any other key are ignored.
    ``max_round_jump``: an announcement more than this many rounds past the last one the
    device answered is ignored and counted, never trained on or recorded. A forged round
    2^31-1 would otherwise be recorded as answered and make the device refuse every real
    round after it, across restarts. A device offline for a long time may need it raised
    (rounds every 5 minutes make 10,000 in five weeks).

    ``ca``: the fleet CA's certificate (make-certs.sh's ``ca.crt``), pinned; ``certificate``:
    the one it issued this device for ``key`` (``clients/<agent_id>.crt``). A signed
    device needs both for secure aggregation: it sends its certificate with its signed
    advertisement, and takes its neighbours' keys only in advertisements their
    certificates from that CA vouch for (secagg/enrolled.py), never on the coordinator's
    word.
    """

    insecure: bool = False
    key: Path | None = None
    coordinator: Path | None = None
    max_round_jump: int = 10_000
    ca: Path | None = None
    certificate: Path | None = None

    def __post_init__(self) -> None:
        if self.max_round_jump < 1:
            raise ValueError(f"max_round_jump must be at least 1, got {self.max_round_jump}")
        if not self.insecure and (self.key is None or self.coordinator is None):
            raise ValueError(
                "security.key (this device's private key) and security.coordinator (the "
                "coordinator's public key or certificate) are required; or set "
                "security.insecure = true to run unsigned"
            )
        if (self.ca is None) != (self.certificate is None):
            raise ValueError(
                "security.ca (the fleet CA's certificate) and security.certificate (the one "
                "it issued this device) go together"
            )


@dataclass(frozen=True)
class CoordinatorSecurity:
    """``key``: the coordinator's private key; ``devices``: a folder of enrolled devices'
    public keys or certificates, one PEM file ``<agent_id>.crt``, ``.pub`` or ``.pem``
    each (make-certs.sh's ``clients/*.crt`` will do; :mod:`runtime.keyfiles` lists the
    formats). Only enrolled devices' signed updates are accepted; enrolment is the file's
    presence, so removing it (and reloading) takes a device out.

    ``ca``: the fleet CA's certificate (make-certs.sh's ``ca.crt``). With it only
    certificates that CA issued to the file's client id are enrolled; a bare public key,
    a self-signed certificate or one of another CA stops the coordinator with a line
    naming the file. ``crl``: that CA's revocation list (make-certs.sh's ``crl.pem``, the
    file the broker reads): a device whose certificate it revokes is not enrolled, and its
    updates are rejected as ``revoked``. Both are read again on every reload (SIGHUP)."""

    insecure: bool = False
    key: Path | None = None
    devices: Path | None = None
    ca: Path | None = None
    crl: Path | None = None

    def __post_init__(self) -> None:
        if not self.insecure and (self.key is None or self.devices is None):
            raise ValueError(
                "security.key (the coordinator's private key) and security.devices (a folder "
                "of enrolled device keys) are required; or set security.insecure = true to "
                "run unsigned"
            )
        if self.crl is not None and self.ca is None:
            raise ValueError(
                "security.crl needs security.ca, the fleet CA that signed it (make-certs.sh's "
                "ca.crt): a revocation list is only trusted as its CA's"
            )
