"""The announcements an agent ignored (forged, of another fleet's shape, implausible),
counted by reason for ``edge-agent status``. Saved in the state folder at most every
:data:`IGNORED_SAVE_S`: a flood of them must not become a flood of disk writes."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

from edge_agent.state import StateDir

log = logging.getLogger(__name__)

#: Seconds between two saves (and log lines) of the ignored-announcement counts.
IGNORED_SAVE_S = 10.0

_KEY = "ignored_announcements"


class IgnoredAnnouncements:
    def __init__(self, state: StateDir) -> None:
        self.state = state
        self.counts: Counter[str] = Counter(state.snapshot.extra.get(_KEY, {}))
        self._saved = -math.inf

    def add(self, reason: str, why: str) -> None:
        """Count one, saved (and logged with ``why``) unless a save came shortly before."""
        self.counts[reason] += 1
        now = time.monotonic()
        if now - self._saved >= IGNORED_SAVE_S:
            self._saved = now
            self.state.record(**{_KEY: dict(self.counts)})
            log.warning("announcement ignored: %s (%d so far)", why, sum(self.counts.values()))

    def flush(self) -> None:
        """Save the counts not saved yet (a round is about to be written anyway)."""
        if self.counts != Counter(self.state.snapshot.extra.get(_KEY, {})):
            self.state.record(**{_KEY: dict(self.counts)})
