"""Rejected messages by reason: counted in memory as they arrive, written to the store
and logged in batches (a rejected update also counts at once in its labelled metric)."""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import Counter

from coordinator.metrics import Metrics
from coordinator.storage.store import Store

log = logging.getLogger(__name__)


class Rejections:
    """Thread-safe: messages are rejected on the transport's thread while the service's
    loop calls :meth:`flush`."""

    def __init__(self, *, store: Store, metrics: Metrics) -> None:
        self._store = store
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        # One labelled child per reason (a handful), looked up once: a flood costs little.
        self._update_metric = functools.cache(
            lambda reason: metrics.updates_rejected.labels(reason=reason)
        )

    def reject_update(self, reason: str, *, round_: int | None, client: str | None) -> None:
        """Count one rejected update (``round_`` and ``client`` as far as they are known)."""
        self._update_metric(reason).inc()
        self.count(reason)
        if log.isEnabledFor(logging.DEBUG):  # one line each: a flood must stay cheap
            log.debug(
                "rejected update from %s for round %s: %s",
                client,
                round_,
                reason,
                extra={
                    "event": "update_rejected",
                    "round": round_,
                    "client": client,
                    "reason": reason,
                },
            )

    def count(self, reason: str) -> None:
        # Counted in memory and written by flush(): a burst of 20,000 junk messages must
        # not become 20,000 SQLite transactions and log lines.
        with self._lock:
            self._counts[reason] += 1

    def flush(self) -> dict[str, int]:
        """Write the rejections counted since the last flush to the database and log them
        as one line (per reason); returns them. The service calls this every few seconds
        and when it stops."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        if not counts:
            return {}
        self._store.count_rejections(counts)
        # A status message's reasons carry the prefix status_; the rest are updates'.
        updates = {r: n for r, n in counts.items() if not r.startswith("status_")}
        statuses = {r[len("status_") :]: n for r, n in counts.items() if r.startswith("status_")}
        for what, table in (("updates", updates), ("status messages", statuses)):
            if table:
                # Duplicates are QoS 1 and re-sends doing their job; the rest deserve a look.
                level = logging.INFO if set(table) <= {"duplicate"} else logging.WARNING
                log.log(
                    level,
                    "rejected %d %s since the last report: %s",
                    sum(table.values()),
                    what,
                    ", ".join(f"{n} {r}" for r, n in sorted(table.items())),
                    extra={"event": "rejections", "counts": json.dumps(table, sort_keys=True)},
                )
        return dict(counts)
