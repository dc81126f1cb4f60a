"""What goes wrong in a secure-aggregation round, as one small tree of exceptions.

A malformed message is a :class:`~protocol.errors.ProtocolError` (raised while decoding it,
before any of this package sees it); the errors here are about well-formed messages that
the protocol must refuse, and about rounds that cannot finish.
"""

from __future__ import annotations


class SecAggError(ValueError):
    """Base of the package's errors: which round, which device (if one is to blame)."""

    reason = "secagg"

    def __init__(self, message: str, *, round: int, client: str | None = None) -> None:
        self.round = round
        self.client = client
        prefix = f"round {round}" + (f", {client}" if client else "")
        super().__init__(f"{prefix}: {message}")


class Refused(SecAggError):
    """A well-formed message this party will not act on: out of stage, from a stranger,
    inconsistent with what it saw before, or asking for what it must never give."""

    reason = "refused"


class Excluded(Refused):
    """An advertisement the round will not take at all (its keys are unusable, or it was
    made from another ``[secure_aggregation]`` table): unlike a message merely dropped,
    its sender is told ``why`` in an :class:`~secagg.messages.Abort`, so that the
    device's log says what to fix."""

    reason = "excluded"

    def __init__(self, why: str, *, round: int, client: str, holds: int | None = None) -> None:
        self.why = why
        #: What the fleet's sum holds of it, for a device wrong about that (Abort.holds).
        self.holds = holds
        super().__init__(f"{client} {why}", round=round, client=client)


class RoundAborted(SecAggError):
    """The round cannot finish: too few devices are left at ``stage``, or the shares that
    would rebuild some secret are too few or disagree. ``why`` is the reason alone, fit
    for an :class:`~secagg.messages.Abort`."""

    reason = "aborted"

    def __init__(self, why: str, *, round: int, stage: str) -> None:
        self.stage = stage
        self.why = why
        super().__init__(f"aborted at {stage}: {why}", round=round)
