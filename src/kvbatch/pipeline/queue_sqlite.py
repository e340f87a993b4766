"""The SQLite store of the queue: one file in the output folder, for workers on one machine.

WAL + synchronous=FULL: an acknowledged row survives a crash or power loss. A transaction is
`BEGIN IMMEDIATE` (the write lock up front), so two claimers never pick the same rows. Not for a
network file system (SQLite's locks are not safe there): several hosts use the PostgreSQL store.

Schema versions (`PRAGMA user_version`): 1 = the columns below without `job`; 2 = a `job` column in
every table (always '' here: one file holds one job; the SQL is the same as PostgreSQL's). Older
files gain the missing columns when opened.
"""
from __future__ import annotations

import contextlib
import fcntl
import sqlite3
import time
from pathlib import Path
from typing import Iterator

from kvbatch.engine.errors import KvbatchConfigError

VERSION = 2
LOCK = ".kvbatch.lock"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v TEXT, job TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS rows(
  key TEXT PRIMARY KEY, pos INTEGER NOT NULL, payload TEXT NOT NULL,
  state TEXT NOT NULL DEFAULT 'pending' CHECK(state IN ('pending','leased','done','error')),
  attempts INTEGER NOT NULL DEFAULT 0, worker TEXT, lease_until REAL,
  part TEXT, error_code TEXT, updated_at REAL NOT NULL, crashes INTEGER NOT NULL DEFAULT 0,
  running INTEGER NOT NULL DEFAULT 0, alone_crashes INTEGER NOT NULL DEFAULT 0, job TEXT NOT NULL DEFAULT '',
  generated INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS rows_state ON rows(state, pos);
CREATE TABLE IF NOT EXISTS manifest(pos INTEGER PRIMARY KEY, key TEXT NOT NULL, job TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS attempts(
  id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, attempt INTEGER NOT NULL,
  worker TEXT NOT NULL, claimed_at REAL NOT NULL, ended_at REAL, outcome TEXT,
  part TEXT, error_code TEXT, alone INTEGER NOT NULL DEFAULT 0, job TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS attempts_open ON attempts(key, ended_at);
CREATE TABLE IF NOT EXISTS superseded(key TEXT NOT NULL, part TEXT, worker TEXT, reason TEXT, at REAL,
  job TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS superseded_key ON superseded(key);
CREATE TABLE IF NOT EXISTS workers(
  id TEXT PRIMARY KEY, pid INTEGER, host TEXT, started_at REAL, heartbeat_at REAL,
  ended_at REAL, rows INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0,
  wall_s REAL, summary TEXT, stop TEXT, job TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS checkpoints(
  job TEXT NOT NULL DEFAULT '', key TEXT NOT NULL, fingerprint TEXT NOT NULL, n INTEGER NOT NULL,
  tokens BLOB NOT NULL, state TEXT NOT NULL, checksum TEXT NOT NULL, saves INTEGER NOT NULL DEFAULT 0,
  worker TEXT, at REAL, discarded TEXT, PRIMARY KEY(job, key));
"""
# Columns added after the first release: (table, column, declaration), added to older queue files.
MIGRATIONS = (("rows", "crashes", "INTEGER NOT NULL DEFAULT 0"), ("workers", "stop", "TEXT"),
              ("rows", "running", "INTEGER NOT NULL DEFAULT 0"),
              ("rows", "alone_crashes", "INTEGER NOT NULL DEFAULT 0"),
              ("attempts", "alone", "INTEGER NOT NULL DEFAULT 0"),
              *((t, "job", "TEXT NOT NULL DEFAULT ''")
                for t in ("meta", "rows", "manifest", "attempts", "superseded", "workers")),
              ("rows", "generated", "INTEGER NOT NULL DEFAULT 0"))


class QueueUnreadable(KvbatchConfigError):
    """queue.sqlite exists but SQLite cannot use it (corrupt, not a database, unwritable)."""


class SqliteStore:
    """One queue file; `job` is '' (the file is the job's own)."""

    kind = "sqlite"
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
    transient: tuple[type[BaseException], ...] = ()  # busy waits are SQLite's own (timeout)
    conflict = {"rows": "(key)", "workers": "(id)", "meta": "(k)"}
    lock_rows = ""  # BEGIN IMMEDIATE already serializes claimers

    def __init__(self, path: Path | str, timeout_s: float = 60.0):
        self.path = Path(path)
        self.job = ""
        self.where = str(self.path)
        self.timeout_s = timeout_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self._migrate()
        except sqlite3.DatabaseError as exc:  # OperationalError included
            raise QueueUnreadable(
                f"{self.path}: the queue cannot be opened ({exc}); finished rows are safe in parts/: "
                f"delete {self.path.name} (and its -wal/-shm files) and run the same command again "
                f"to rebuild the queue from the input and the parts") from None

    def _migrate(self) -> None:
        have = self.db.execute("PRAGMA user_version").fetchone()[0]
        if have > VERSION:
            raise QueueUnreadable(f"{self.path}: written by a newer kvbatch (queue schema {have}, this one "
                                  f"knows {VERSION}); upgrade kvbatch to use this folder")
        self.db.executescript(SCHEMA)
        for table, col, decl in MIGRATIONS:
            cols = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if col not in cols:
                try:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {decl}")
                except sqlite3.OperationalError as exc:  # another process added it first
                    if "duplicate column" not in str(exc):
                        raise
        if have < VERSION:
            self.db.execute(f"PRAGMA user_version={VERSION}")

    def version(self) -> int:
        """The file's schema version (PRAGMA user_version)."""
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def execute(self, sql: str, args=()):
        """Run one SQL statement and return its cursor."""
        return self.db.execute(sql, args)

    def executemany(self, sql: str, rows) -> None:
        """Run one SQL statement for each of `rows`."""
        self.db.executemany(sql, rows)

    @contextlib.contextmanager
    def tx(self) -> Iterator[None]:
        """BEGIN IMMEDIATE: take the write lock up front, so two claimers never pick the same rows."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def now(self) -> float:
        """This machine's clock, in seconds since the epoch."""
        return time.time()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The output folder's lock file (reconcile, finalize): one process at a time on this machine."""
        with open(self.path.parent / LOCK, "a") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def lost(self) -> bool:
        """A file's connection is never dropped by a server."""
        return False

    def reconnect(self) -> None:
        """Nothing to reconnect to (see lost)."""

    def reopen(self) -> "SqliteStore":
        """A new connection to the same file."""
        return SqliteStore(self.path, self.timeout_s)

    def close(self) -> None:
        """Close the connection."""
        self.db.close()
