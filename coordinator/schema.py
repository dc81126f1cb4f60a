"""The coordinator database's tables (coordinator/store.py is their only reader and writer)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER PRIMARY KEY,
    opened_at REAL NOT NULL,
    deadline REAL NOT NULL,
    closed_at REAL,
    announcement BLOB NOT NULL,
    extensions INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS updates (
    round INTEGER NOT NULL,
    client TEXT NOT NULL,
    received_at REAL NOT NULL,
    payload BLOB NOT NULL,
    PRIMARY KEY (round, client)
);
CREATE TABLE IF NOT EXISTS clients (
    client TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    version TEXT NOT NULL,
    last_round INTEGER,
    reason TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rejections (reason TEXT PRIMARY KEY, count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine (
    round INTEGER NOT NULL,
    client TEXT NOT NULL,
    received_at REAL NOT NULL,
    payload BLOB NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (round, client)
);
CREATE TABLE IF NOT EXISTS statistics (
    client TEXT PRIMARY KEY,
    round INTEGER NOT NULL,
    payload BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS contributions (
    client TEXT PRIMARY KEY,
    last_round INTEGER NOT NULL,
    last_at REAL NOT NULL,
    updates INTEGER NOT NULL
);
"""

#: A database from before the contributions table: fill it from the updates it holds.
BACKFILL = """
INSERT OR IGNORE INTO contributions
SELECT client, MAX(round), MAX(received_at), COUNT(*) FROM updates GROUP BY client
"""


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
)
