"""Which announcements a device answers: the checks that come before anything of an
announcement is trained on or recorded."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import protocol
from edge_agent.config import AgentConfig
from protocol import RoundAnnouncement

log = logging.getLogger(__name__)

#: A device's status reason while it refuses the fleet's announcements as not signed by
#: the coordinator key it pinned; the coordinator counts and alerts on it
#: (coordinator/rounds/presence.py). Taken back once a signed announcement is answered.
BAD_COORDINATOR_SIGNATURE = (
    f"{protocol.BAD_COORDINATOR_SIGNATURE}: announcements are not signed by the coordinator "
    "key this device pinned (security.coordinator); check it pairs with the coordinator's "
    "security.key"
)

#: Decisions on announcements no coordinator of this fleet sends: they say nothing of the
#: fleet's open round.
IGNORED = frozenset(
    {
        "wrong_fleet",
        "wrong_dim",
        "implausible_round",
        "old_run",
        "announcement_unsigned",
        "announcement_bad_signature",
    }
)


def wrong_dim(announcement: RoundAnnouncement, *, dim: int) -> tuple[str, str] | None:
    """(reason, why) for an announcement whose prototypes have another dimension than
    ``dim`` (the head's; the backbone features' under dp-features): the announced ``dim``
    (said from round 0, before any global prototype carries it) or its rows. Ignored
    before anything of it is trained on, followed or recorded."""
    rows = announcement.global_prototypes
    clusters = announcement.extras.get("clusters")
    dims = {announcement.dim} | ({rows.shape[1]} if rows.shape[0] else set())
    if clusters is not None:
        dims.add(clusters.shape[-1] if clusters.ndim == 2 else -1)
    if dims - {dim}:
        shown = ", ".join(str(d) for d in sorted(dims - {dim}))
        return "wrong_dim", (
            f"round {announcement.round} announces prototypes of dimension {shown}, this "
            f"device expects {dim} ([train] out_dim, or the features' under dp-features)"
        )
    return None


def implausible_round(
    announcement: RoundAnnouncement, cfg: AgentConfig, last_round: int | None
) -> tuple[str, str] | None:
    """(reason, why) for a round too far past the last answered in the run followed: no
    coordinator of this fleet skips that many."""
    jump = cfg.security.max_round_jump
    if last_round is not None and announcement.round > last_round + jump:
        return "implausible_round", (
            f"round {announcement.round} is more than {jump} rounds past the last one this "
            f"device answered ({last_round}; [security] max_round_jump)"
        )
    return None


def mismatch(
    announcement: RoundAnnouncement, cfg: AgentConfig, bundle_id: str
) -> tuple[str, str] | None:
    """(reason, what differs) when this device cannot answer the fleet's rounds at all."""
    if announcement.bundle != bundle_id:
        return "wrong_bundle", (
            f"the fleet uses bundle {announcement.bundle[:12]}, this device has {bundle_id[:12]}"
        )
    if announcement.method != cfg.method:
        return "wrong_method", f"the fleet runs {announcement.method}, this device {cfg.method}"
    theirs, ours = tuple(announcement.classes), tuple(cfg.classes)
    if theirs != ours:
        first = next(
            (i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
            min(len(theirs), len(ours)),
        )
        return "wrong_classes", (
            f"the fleet announces {len(theirs)} classes, this device has {len(ours)}; "
            f"they differ from position {first}"
        )
    return None


def note_params(params: Mapping[str, Any], *, own: Mapping[str, Any], noted: set[str]) -> None:
    """The coordinator's ``[model.params]`` say how the fleet means to train; a device
    trains with its own ``[train]`` section (``own``). Where the two differ, say so once per
    setting (``noted`` holds those said), so that a fleet mixing, say, two temperatures
    does not go unnoticed."""
    for key, value in params.items():
        if key in own and own[key] != value and key not in noted:
            noted.add(key)
            log.warning(
                "the coordinator announces %s = %r; this device trains with %s = %r "
                "(its config's [train] section)",
                key,
                value,
                key,
                own[key],
            )
