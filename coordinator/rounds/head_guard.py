"""A closed-form fleet is never left without a head: a round whose statistics give no
head, or one that lacks a class the last good one had and devices still hold (counts
driven below one example delete a class), announces the last good head again, and says so in a log line,
in ``edge-coordinator status`` (the meta table's :data:`HEAD_KEY`) and in the
``protofleet_head_kept`` gauge, naming the clients whose statistics changed in that round
so that an operator can drop them (``edge-coordinator forget``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import numpy as np

from coordinator.metrics import Metrics
from coordinator.strategies import Aggregate
from protocol import RoundAnnouncement

log = logging.getLogger(__name__)

#: The meta-table key of the last head refusal ("" once a round's head is taken again).
HEAD_KEY = "head_kept"


def refusal(head: Aggregate, last: RoundAnnouncement, *, held: frozenset[int] | None = None) -> str:
    """Why ``head`` may not replace the head ``last`` announces; "" when it may (and
    always when ``last`` carries none: there is nothing better to keep). ``held``: the
    classes some device's statistics hold, where the tally knows each device's (a class
    no device holds any more may leave the head); None: any class lost is refused."""
    had = set(last.global_classes)
    if not had:
        return ""
    if not head.global_classes:
        return "its statistics solve no head"
    lost = had - set(head.global_classes)
    if held is not None:
        lost &= held
    if lost:
        return f"its head lacks class(es) {sorted(lost)} that the last one had" + (
            " and devices still hold" if held is not None else ""
        )
    return ""


def last_head(last: RoundAnnouncement) -> Aggregate:
    """The head ``last`` announces, to announce again."""
    return Aggregate(
        global_classes=last.global_classes,
        global_prototypes=np.asarray(last.global_prototypes, dtype=np.float64),
        extras={name: np.asarray(a, dtype=np.float64) for name, a in last.extras.items()},
    )


def guarded(
    head: Aggregate, last: RoundAnnouncement, *, held: frozenset[int] | None = None
) -> tuple[Aggregate, str]:
    """``head``, or the last good one with the reason it was kept (module text)."""
    why = refusal(head, last, held=held)
    return (last_head(last), why) if why else (head, "")


def report(
    *, round_: int, kept: str, clients: Sequence[str], metrics: Metrics, closed_form: bool
) -> dict[str, str]:
    """Say whether round ``round_`` kept the last head; the meta entry its close writes
    (none for a fleet with no closed-form head)."""
    if not closed_form:
        return {}
    metrics.head_kept.set(1 if kept else 0)
    if not kept:
        return {HEAD_KEY: ""}
    named = ", ".join(clients) or "none named (a secure sum)"
    log.warning(
        "round %d: the last good head is announced again: %s; statistics changed by: %s "
        "(docs/deploy.md, 'A device's statistics')",
        round_, kept, named,
        extra={"event": "head_kept", "round": round_, "clients": list(clients)},
    )  # fmt: skip
    return {HEAD_KEY: json.dumps({"round": round_, "why": kept, "clients": list(clients)})}
