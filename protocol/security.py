"""The ``[security]`` sections of the agent's and the coordinator's configurations."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AgentSecurity:
    """What a device takes from the round topic.

    ``max_round_jump``: an announcement more than this many rounds past the last one the
    device answered is ignored and counted, never trained on or recorded. A forged round
    2^31-1 would otherwise be recorded as answered and make the device refuse every real
    round after it, across restarts. A device offline for a long time may need it raised
    (rounds every 5 minutes make 10,000 in five weeks).
    """

    max_round_jump: int = 10_000

    def __post_init__(self) -> None:
        if self.max_round_jump < 1:
            raise ValueError(f"max_round_jump must be at least 1, got {self.max_round_jump}")
