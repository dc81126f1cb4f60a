"""What ``edge-coordinator status`` prints, read from the coordinator database
(:meth:`coordinator.storage.store.Store.summary` reads it under the store's lock, as one snapshot)."""

from __future__ import annotations

import json
import math
import sqlite3
from typing import Any

from protocol import BAD_COORDINATOR_SIGNATURE
from protocol.limits import PROTOCOL_VERSION
from protocol.status import UNSUPPORTED_VERSION

#: A client in ``edge-coordinator status``: what its last status message said (``state``
#: to ``updated_at``; None if none came) and what the coordinator accepted from it.
CLIENT_FIELDS = (
    "client",
    "state",
    "version",
    "last_round",
    "reason",
    "updated_at",
    "last_update_round",
    "updates_accepted",
    "last_update_at",
    "protocol",
)


def read_summary(db: sqlite3.Connection, *, online_since: float = -math.inf) -> dict[str, Any]:
    """The open round, the rounds completed, every client heard from, the rejections and
    the quarantine; a client counts as online if its last status says so and came after
    ``online_since``."""
    latest = db.execute(
        "SELECT round, opened_at, deadline, closed_at, extensions FROM rounds "
        "ORDER BY round DESC LIMIT 1"
    ).fetchone()
    completed = _one(db, "SELECT COUNT(*) FROM rounds WHERE closed_at IS NOT NULL")
    # Every client heard from: by its status messages, its updates, or both.
    clients = db.execute(
        "SELECT n.client, s.state, s.version, s.last_round, s.reason, s.updated_at, "
        "c.last_round, c.updates, c.last_at, s.protocol FROM "
        "(SELECT client FROM clients UNION SELECT client FROM contributions) AS n "
        "LEFT JOIN clients AS s ON s.client = n.client "
        "LEFT JOIN contributions AS c ON c.client = n.client ORDER BY n.client"
    ).fetchall()
    rejections = dict(db.execute("SELECT reason, count FROM rejections ORDER BY reason").fetchall())
    in_round = (
        _one(db, "SELECT COUNT(*) FROM updates WHERE round = ?", (latest[0],)) if latest else 0
    )
    identity = _one(db, "SELECT value FROM meta WHERE key = 'identity'")
    quarantined = _one(db, "SELECT COUNT(*) FROM quarantine")
    run = _one(db, "SELECT value FROM meta WHERE key = 'run'")
    started = _one(db, "SELECT value FROM meta WHERE key = 'run_started'")
    # A closed-form fleet's last head refusal (coordinator/rounds/head_guard.py), while the
    # head it kept is still the one announced.
    kept = _one(db, "SELECT value FROM meta WHERE key = 'head_kept'")
    return {
        "identity": json.loads(identity) if identity else None,
        # The run devices follow (docs/protocol.md, "Runs"): a new one after a lost database.
        "run": None if run is None else {"id": run, "started": float(started or 0.0)},
        "round": None
        if latest is None
        else {
            "number": latest[0],
            "opened_at": latest[1],
            "deadline": latest[2],
            "closed_at": latest[3],
            "updates": in_round,
            "extensions": latest[4],
        },
        "rounds_completed": completed,
        "clients": [dict(zip(CLIENT_FIELDS, row, strict=True)) for row in clients],
        "clients_online": sum(1 for row in clients if row[1] == "online" and row[5] > online_since),
        # Devices that refuse this coordinator's signature: a key that does not pair with
        # the one they pinned (docs/deploy.md, section 4).
        "rejecting_announcements": refusing_signature(db, since=online_since),
        # Devices that cannot read this coordinator's announcements' protocol version
        # (they say so in their status), and those whose last status came in the previous
        # version: the devices an upgrade still waits for (docs/deploy.md, "Upgrading").
        "unsupported_version": clients_saying(db, UNSUPPORTED_VERSION, since=online_since),
        "previous_version": on_previous_version(db),
        "rejections": rejections,
        "quarantined": quarantined,
        "head_kept": json.loads(kept) if kept else None,
    }


def _one(db: sqlite3.Connection, sql: str, args: tuple[Any, ...] = ()) -> Any:
    row = db.execute(sql, args).fetchone()
    return None if row is None else row[0]


def refusing_signature(db: sqlite3.Connection, *, since: float = -math.inf) -> list[str]:
    """Clients online after ``since`` whose last status says they refuse this
    coordinator's announcements' signature (status reason bad_coordinator_signature)."""
    return clients_saying(db, BAD_COORDINATOR_SIGNATURE, since=since)


def clients_saying(db: sqlite3.Connection, prefix: str, *, since: float = -math.inf) -> list[str]:
    """Clients online after ``since`` whose last status reason starts with ``prefix``."""
    rows = db.execute(
        "SELECT client FROM clients WHERE state = 'online' AND updated_at > ? "
        "AND substr(reason, 1, ?) = ? ORDER BY client",
        (since, len(prefix), prefix),
    ).fetchall()
    return [row[0] for row in rows]


def on_previous_version(db: sqlite3.Connection) -> list[str]:
    """Clients whose last status came in an older protocol version than this code's."""
    rows = db.execute(
        "SELECT client FROM clients WHERE protocol < ? ORDER BY client", (PROTOCOL_VERSION,)
    ).fetchall()
    return [row[0] for row in rows]
