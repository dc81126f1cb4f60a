"""The coordinator database: how it is opened (page size, write-ahead log, sync level),
its tables, and the migration of one an older version wrote (coordinator/storage/store.py is
their only reader and writer)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

#: Bytes per database page, and the write-ahead log's checkpoint size.
PAGE_SIZE = 16_384
WAL_CHECKPOINT_BYTES = 4 << 20
#: Past this the writer checkpoints itself, as a backstop should the checkpointer
#: (coordinator/storage/checkpointer.py) fall behind: the log of a 4 MB disk's database must not
#: outgrow the disk unnoticed.
WAL_BACKSTOP_BYTES = 64 << 20

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
    updated_at REAL NOT NULL,
    protocol INTEGER NOT NULL DEFAULT 3
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
-- The round owner's record of its workers (coordinator/tier/owner.py): per closed round and
-- worker, the clients its first partial held (its share of the intake), the clients its
-- final partial counted (after the exclusions) and when it answered.
CREATE TABLE IF NOT EXISTS worker_partials (
    round INTEGER NOT NULL,
    worker TEXT NOT NULL,
    held INTEGER NOT NULL,
    counted INTEGER NOT NULL,
    answered_at REAL NOT NULL,
    PRIMARY KEY (round, worker)
);
"""

#: A database from before the contributions table: fill it from the updates it holds.
BACKFILL = """
INSERT OR IGNORE INTO contributions
SELECT client, MAX(round), MAX(received_at), COUNT(*) FROM updates GROUP BY client
"""


class DamagedDatabase(sqlite3.DatabaseError):
    """The database's pages fail SQLite's own check: corruption, not a passing fault."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        # One line: SQLite reports a problem as "*** in database main ***\nOn tree page
        # ...", and a log line (journald, JSON) or an error must not break inside it.
        super().__init__("; ".join(" ".join(p.split()) for p in problems[:3]))


def open_checked(
    path: Path, *, synchronous: str, schema: str, prepare: Callable[[sqlite3.Connection], object]
) -> sqlite3.Connection:
    """The database at ``path`` in autocommit (its owner begins its own transactions):
    ``prepare`` sets its pragmas, then the sync level, then SQLite's own check of its pages
    (:class:`DamagedDatabase`), then ``schema``. sqlite3.Error if it cannot be opened; the
    connection is closed then."""
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    try:
        prepare(db)
        # NORMAL in WAL mode survives a process crash (kill -9); FULL also a power cut.
        db.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'FULL' else 'NORMAL'}")
        # Damaged pages are found here, where the message can say what to do, not by a
        # write hours later whose error would read as a passing storage fault.
        problems = [row[0] for row in db.execute("PRAGMA quick_check(5)")]
        if problems != ["ok"]:
            raise DamagedDatabase(path, problems)
        db.executescript(schema)
    except sqlite3.Error:
        with contextlib.suppress(sqlite3.Error):
            db.close()
        raise
    return db


@contextlib.contextmanager
def immediate(db: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT; on an error, ROLLBACK if a transaction is still open
    and raise the error itself. SQLite rolls back on its own after some errors (a full
    disk among them); a ROLLBACK then fails with "no transaction is active", and raising
    that would hide the cause."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise


def _tune(db: sqlite3.Connection) -> None:
    # Larger pages for a table of large BLOBs (an update is 5 kB to 1.3 MB): at the
    # default 4 KiB a FedAvg update spans dozens of chained overflow pages, and a
    # round of them wrote in 0.95 s against 0.53 s at 16 KiB (1,000 x 208 kB, WAL,
    # development machine). Not larger: 64 KiB pages (0.43 s) made every small
    # write cost a whole page, and a coordinator on a 4 MB disk ran out of it
    # (tests/test_storage_faults.py). Takes effect on a new database only.
    db.execute(f"PRAGMA page_size={PAGE_SIZE}")
    db.execute("PRAGMA journal_mode=WAL")
    # The log is folded back past about 4 MiB, as with SQLite's default pages (its
    # default, 1,000 pages, would let it reach 16 MiB on a small disk), by the
    # checkpointer's thread; the writer's own checkpoint is only the backstop.
    db.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_BYTES // PAGE_SIZE}")
    # A log that a burst grew is cut back once it starts afresh: the file must not
    # keep its largest size on a small disk.
    db.execute(f"PRAGMA journal_size_limit={2 * WAL_CHECKPOINT_BYTES}")


def connect(path: Path, *, synchronous: str) -> sqlite3.Connection:
    """The database at ``path`` opened for the store (autocommit: the store begins its
    own transactions), its tables created or brought up to date. sqlite3.Error if it
    cannot be; the connection is closed then."""
    db = open_checked(path, synchronous=synchronous, schema=SCHEMA, prepare=_tune)
    try:
        migrate(db)
    except sqlite3.Error:
        with contextlib.suppress(sqlite3.Error):
            db.close()
        raise
    return db


def migrate(db: sqlite3.Connection) -> None:
    """Bring a database an older version wrote up to :data:`SCHEMA` (whose ``CREATE TABLE
    IF NOT EXISTS`` adds missing tables, not missing columns)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(rounds)")}
    if "extensions" not in columns:  # a database from before deadline extensions counted
        db.execute("ALTER TABLE rounds ADD COLUMN extensions INTEGER NOT NULL DEFAULT 0")
    columns = {row[1] for row in db.execute("PRAGMA table_info(clients)")}
    if "protocol" not in columns:  # the protocol version of a client's last status
        db.execute("ALTER TABLE clients ADD COLUMN protocol INTEGER NOT NULL DEFAULT 3")
    if db.execute("SELECT COUNT(*) FROM contributions").fetchone()[0] == 0:
        db.execute(BACKFILL)
