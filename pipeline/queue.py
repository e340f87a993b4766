"""The row queue: one SQLite file in the output directory.

Rows are enqueued idempotently by row key and claimed with a lease (worker id +
expiry) that the worker renews while it works; a dead worker's rows come back when
their lease expires. A row becomes `done`/`error` only when its Parquet part is
durable (`ack` after the part is renamed into place). Every claim is recorded in
`attempts` (who, when, how it ended), so a test or `status` can tell who processed
what. WAL + synchronous=FULL: an acknowledged row survives a crash or power loss.

States: pending -> leased -> done | error (terminal), or back to pending
(lease expired, retry, deadline release, lost part).

Two counters per row:
- `attempts`: runs that reached an outcome of the row's own: 1 for the first run, +1 for
  each retry after `internal_error` (what `worker.max_attempts` caps; the `attempt`
  column of the results). A claim that ends without such an outcome does not count: the
  worker died or lost its lease, the deadline or Ctrl-C handed the row back, or its
  finished part was lost.
- `crashes`: how often a worker died (or stopped renewing its lease) while the row was
  running in its engine (`running`: set when the worker hands the row to the engine,
  cleared when it finishes, so rows that were only claimed, or finished and not yet
  written, are never charged). A crash is not the row's fault, but a row that kills its
  worker every time must not stop the job forever: the worker runs rows with
  `crashes >= isolate_after` alone and ends rows at `max_crashes` with internal_error
  (see Queue.claim, Worker); `alone_crashes` counts the crashes observed while the row
  ran alone (the give-up message reports it, and a row is given up only after them).

Regenerating a finished row (its input content changed, or the memory budget changed for a
row refused for memory): the row goes back to pending with fresh counters, and the results
it had are recorded in `superseded` ((key, part) for a result in a part, (key, worker) for
whatever a worker holding it at that moment writes), so reconcile and finalize never take
them again and results.parquet holds only the new outcome.

A worker that ended (any way, a failure included) holds nothing: rows still leased by
it go back to pending at once, without counting an attempt or a crash.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from kvbatch.engine.errors import KvbatchConfigError

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v TEXT);
CREATE TABLE IF NOT EXISTS rows(
  key TEXT PRIMARY KEY, pos INTEGER NOT NULL, payload TEXT NOT NULL,
  state TEXT NOT NULL DEFAULT 'pending' CHECK(state IN ('pending','leased','done','error')),
  attempts INTEGER NOT NULL DEFAULT 0, worker TEXT, lease_until REAL,
  part TEXT, error_code TEXT, updated_at REAL NOT NULL, crashes INTEGER NOT NULL DEFAULT 0,
  running INTEGER NOT NULL DEFAULT 0, alone_crashes INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS rows_state ON rows(state, pos);
CREATE TABLE IF NOT EXISTS manifest(pos INTEGER PRIMARY KEY, key TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS attempts(
  id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, attempt INTEGER NOT NULL,
  worker TEXT NOT NULL, claimed_at REAL NOT NULL, ended_at REAL, outcome TEXT,
  part TEXT, error_code TEXT, alone INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS attempts_open ON attempts(key, ended_at);
CREATE TABLE IF NOT EXISTS superseded(key TEXT NOT NULL, part TEXT, worker TEXT, reason TEXT, at REAL);
CREATE INDEX IF NOT EXISTS superseded_key ON superseded(key);
CREATE TABLE IF NOT EXISTS workers(
  id TEXT PRIMARY KEY, pid INTEGER, host TEXT, started_at REAL, heartbeat_at REAL,
  ended_at REAL, rows INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0,
  wall_s REAL, summary TEXT, stop TEXT);
"""
# Columns added after the first release: (table, column, declaration), added to older queue files.
MIGRATIONS = (("rows", "crashes", "INTEGER NOT NULL DEFAULT 0"), ("workers", "stop", "TEXT"),
              ("rows", "running", "INTEGER NOT NULL DEFAULT 0"),
              ("rows", "alone_crashes", "INTEGER NOT NULL DEFAULT 0"),
              ("attempts", "alone", "INTEGER NOT NULL DEFAULT 0"))
TERMINAL = ("done", "error")


@dataclass
class Claimed:
    key: str
    pos: int
    payload: dict
    attempt: int  # 1 for the first run; +1 per internal_error retry (crashes do not count)
    crashes: int = 0  # times a worker died while this row ran in its engine (this claim's previous holders)
    alone_crashes: int = 0  # ... of them while the row ran alone


class QueueUnreadable(KvbatchConfigError):
    """queue.sqlite exists but SQLite cannot use it (corrupt, not a database, unwritable)."""


class Queue:
    def __init__(self, path: Path | str, timeout_s: float = 60.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(SCHEMA)
            self._migrate()
        except sqlite3.DatabaseError as exc:  # OperationalError included
            raise QueueUnreadable(
                f"{self.path}: the queue cannot be opened ({exc}); finished rows are safe in parts/: "
                f"delete {self.path.name} (and its -wal/-shm files) and run the same command again "
                f"to rebuild the queue from the input and the parts") from None

    def _migrate(self) -> None:
        for table, col, decl in MIGRATIONS:
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if col not in have:
                try:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {decl}")
                except sqlite3.OperationalError as exc:  # another process added it first
                    if "duplicate column" not in str(exc):
                        raise

    def close(self) -> None:
        self.db.close()

    def _tx(self):
        """BEGIN IMMEDIATE: take the write lock up front, so two claimers never pick the same rows."""
        return _Tx(self.db)

    # ---- enqueue ---------------------------------------------------------------------------
    def enqueue(self, rows: Iterable) -> int:
        """Add rows (InputRow-like: pos, key, payload) not seen before; the manifest becomes
        exactly these keys in this order. Returns how many rows were new."""
        now, added = time.time(), 0
        with self._tx():
            self.db.execute("DELETE FROM manifest")
            for r in rows:
                cur = self.db.execute(
                    "INSERT OR IGNORE INTO rows(key, pos, payload, updated_at) VALUES (?,?,?,?)",
                    (r.key, r.pos, json.dumps(r.payload, ensure_ascii=False), now))
                added += cur.rowcount
                if not cur.rowcount:  # the payload follows the input (see changed(): regenerate those rows)
                    self.db.execute("UPDATE rows SET pos=?, payload=? WHERE key=?",
                                    (r.pos, json.dumps(r.payload, ensure_ascii=False), r.key))
                self.db.execute("INSERT INTO manifest(pos, key) VALUES (?,?)", (r.pos, r.key))
        return added

    def changed(self, rows: Iterable) -> list[str]:
        """Keys of rows already queued whose content (payload) differs from `rows` (an edited input)."""
        stored = dict(self.db.execute("SELECT key, payload FROM rows"))
        return [r.key for r in rows if r.key in stored and json.loads(stored[r.key]) != r.payload]

    def keys_with_error(self, code: str) -> list[str]:
        return [k for (k,) in self.db.execute("SELECT r.key FROM rows r JOIN manifest m ON m.key=r.key "
                                              "WHERE r.state='error' AND r.error_code=?", (code,))]

    def error_keys(self, codes: list[str]) -> list[str]:
        """Manifest rows that ended with one of `codes` (every error code when empty), in input order."""
        where = f" AND r.error_code IN ({','.join('?' * len(codes))})" if codes else ""
        return [k for (k,) in self.db.execute("SELECT r.key FROM rows r JOIN manifest m ON m.key=r.key "
                                              f"WHERE r.state='error'{where} ORDER BY m.pos", list(codes))]

    def regenerate(self, keys: list[str], in_parts: list[tuple[str, str]], reason: str) -> None:
        """Rows to be generated again from scratch: pending, counters reset; every result they have
        (`in_parts`: (key, part) found on disk, and the row's acknowledged part) and whatever the
        worker holding one now writes is superseded, never taken again."""
        now, wanted = time.time(), set(keys)
        with self._tx():
            for key, part in in_parts:
                if key in wanted:
                    self.db.execute("INSERT INTO superseded(key, part, reason, at) VALUES (?,?,?,?)",
                                    (key, part, reason, now))
            for key in keys:
                row = self.db.execute("SELECT state, part, worker FROM rows WHERE key=?", (key,)).fetchone()
                if row is None:
                    continue
                state, part, worker = row
                if part:
                    self.db.execute("INSERT INTO superseded(key, part, reason, at) VALUES (?,?,?,?)",
                                    (key, part, reason, now))
                if state == "leased" and worker:
                    self.db.execute("INSERT INTO superseded(key, worker, reason, at) VALUES (?,?,?,?)",
                                    (key, worker, reason, now))
                    self._end_attempt(key, reason, now, worker)
                self.db.execute("UPDATE rows SET state='pending', part=NULL, error_code=NULL, worker=NULL, "
                                "lease_until=NULL, running=0, attempts=0, crashes=0, alone_crashes=0, updated_at=? "
                                "WHERE key=?", (now, key))
                self.db.execute("UPDATE attempts SET outcome=? WHERE id=(SELECT MAX(id) FROM attempts WHERE key=?) "
                                "AND ended_at IS NOT NULL", (reason, key))

    def superseded(self) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
        """({(key, part)}, {(key, worker)}): results that belong to older content or settings."""
        by_part, by_worker = set(), set()
        for key, part, worker in self.db.execute("SELECT key, part, worker FROM superseded"):
            (by_part.add((key, part)) if part else by_worker.add((key, worker)))
        return by_part, by_worker

    # ---- leases ----------------------------------------------------------------------------
    def claim(self, worker: str, n: int, lease_s: float, idle: bool = True,
              isolate_after: Optional[int] = None, max_crashes: Optional[int] = None) -> list[Claimed]:
        """Lease up to n manifest rows that are pending or whose lease has expired, in input order.

        A row whose lease expired was held by a worker that died (or stopped renewing): its
        crash count goes up and that claim is not counted as an attempt. Rows with at least
        `isolate_after` crashes (and fewer than `max_crashes`) are claimed only alone, and only
        by an `idle` worker (nothing in flight): a row that kills its worker then takes no
        batch mates with it. Rows at `max_crashes` are claimed like any other (the worker ends
        them without running them)."""
        if n <= 0:
            return []
        now = time.time()
        out: list[Claimed] = []

        def alone(crashes: int) -> bool:
            return isolate_after is not None and crashes >= isolate_after and \
                (max_crashes is None or crashes < max_crashes)

        with self._tx():
            picked: list[tuple] = []
            after, full = -1, False
            while not full:
                page = self.db.execute(
                    "SELECT r.key, m.pos, r.attempts, r.crashes, r.state, r.running FROM rows r JOIN manifest m "
                    "ON m.key = r.key WHERE (r.state='pending' OR (r.state='leased' AND r.lease_until < ?)) "
                    "AND m.pos > ? ORDER BY m.pos LIMIT ?", (now, after, max(4 * n, 64))).fetchall()
                if not page:
                    break
                after = page[-1][1]
                for row in page:
                    if alone(row[3] + (row[4] == "leased" and row[5])):
                        if idle and not picked:  # this row, and nothing else
                            picked.append((*row, True))
                            full = True
                            break
                        continue  # waits until this worker (or another) is idle
                    picked.append((*row, False))
                    if len(picked) >= n:
                        full = True
                        break
            for key, pos, attempts, crashes, state, running, solo in picked:
                if state == "leased":  # its holder stopped renewing: undo that claim's count, charge a crash
                    self._charge(key, running, now)
                    self._end_attempt(key, "expired" if running else "expired_not_running", now)
                    attempts, crashes = attempts - 1, crashes + bool(running)
                self.db.execute("UPDATE rows SET state='leased', worker=?, lease_until=?, attempts=?, crashes=?, "
                                "running=0, updated_at=? WHERE key=?",
                                (worker, now + lease_s, attempts + 1, crashes, now, key))
                self.db.execute("INSERT INTO attempts(key, attempt, worker, claimed_at, alone) VALUES (?,?,?,?,?)",
                                (key, attempts + 1, worker, now, int(solo)))
                payload, alone_n = self.db.execute("SELECT payload, alone_crashes FROM rows WHERE key=?",
                                                   (key,)).fetchone()
                out.append(Claimed(key, pos, json.loads(payload), attempts + 1, crashes, alone_n))
            self.db.execute("UPDATE workers SET heartbeat_at=? WHERE id=?", (now, worker))
        return out

    def _charge(self, key: str, running: int, now: float) -> None:
        """The worker holding `key` died: one more alone crash when the row ran alone in its engine."""
        if running and self.db.execute("SELECT alone FROM attempts WHERE key=? AND ended_at IS NULL "
                                       "ORDER BY id DESC LIMIT 1", (key,)).fetchone() == (1,):
            self.db.execute("UPDATE rows SET alone_crashes=alone_crashes+1, updated_at=? WHERE key=?", (now, key))

    def mark_running(self, worker: str, keys: list[str], running: bool) -> None:
        """Rows this worker handed to its engine (True) or that finished there (False): a crash is
        charged only to rows running at the time."""
        if not keys:
            return
        with self._tx():
            self.db.executemany("UPDATE rows SET running=? WHERE key=? AND state='leased' AND worker=?",
                                [(int(running), k, worker) for k in keys])

    def release_worker(self, worker: str, outcome: str) -> int:
        """Every row this worker still holds goes back to pending, its attempt not counted (the
        worker is ending: finished rows whose part was not written are generated again)."""
        now = time.time()
        with self._tx():
            keys = [k for (k,) in self.db.execute("SELECT key FROM rows WHERE state='leased' AND worker=?",
                                                  (worker,))]
            for key in keys:
                self.db.execute("UPDATE rows SET state='pending', worker=NULL, lease_until=NULL, running=0, "
                                "attempts=MAX(attempts-1, 0), updated_at=? WHERE key=?", (now, key))
                self._end_attempt(key, outcome, now, worker)
        return len(keys)

    def renew(self, worker: str, lease_s: float) -> int:
        """Extend every lease this worker holds; returns how many rows it still holds."""
        now = time.time()
        with self._tx():
            n = self.db.execute("UPDATE rows SET lease_until=? WHERE state='leased' AND worker=?",
                                (now + lease_s, worker)).rowcount
            self.db.execute("UPDATE workers SET heartbeat_at=? WHERE id=?", (now, worker))
        return n

    def ack(self, worker: str, items: list[tuple[str, Optional[str]]], part: str) -> None:
        """Rows (key, error_code) whose results are durable in `part`: done (ok) or error.
        A row already terminal stays as it is (it was acknowledged from another part)."""
        now = time.time()
        with self._tx():
            for key, code in items:
                self.db.execute(
                    "UPDATE rows SET state=?, part=?, error_code=?, worker=?, lease_until=NULL, running=0, "
                    "updated_at=? "
                    "WHERE key=? AND state NOT IN ('done','error') AND NOT EXISTS "
                    "(SELECT 1 FROM superseded s WHERE s.key=rows.key AND s.worker=?)",
                    ("error" if code else "done", part, code, worker, now, key, worker))
                self._end_attempt(key, "error" if code else "done", now, worker, part, code)

    def adopt(self, items: list[tuple[str, Optional[str], str]], part: str) -> None:
        """Rows (key, error_code, writer) found durable in `part` but never acknowledged (their
        writer died between the rename and the ack): finished from that part, and the writer's
        attempt is closed as if it had acknowledged them."""
        now = time.time()
        with self._tx():
            for key, code, writer in items:
                self.db.execute(
                    "UPDATE rows SET state=?, part=?, error_code=?, worker=?, lease_until=NULL, running=0, "
                    "updated_at=? "
                    "WHERE key=? AND state NOT IN ('done','error')",
                    ("error" if code else "done", part, code, writer, now, key))
                self._end_attempt(key, "error" if code else "done", now, writer, part, code)

    def release(self, worker: str, keys: list[str], outcome: str, count_attempt: bool = True) -> None:
        """Give leased rows back (retry, deadline, shutdown); `count_attempt=False` undoes the claim's count."""
        now = time.time()
        with self._tx():
            for key in keys:
                self.db.execute(
                    "UPDATE rows SET state='pending', worker=NULL, lease_until=NULL, running=0, updated_at=?, "
                    "attempts=attempts-? WHERE key=? AND state='leased' AND worker=?",
                    (now, 0 if count_attempt else 1, key, worker))
                self._end_attempt(key, outcome, now, worker)

    def requeue(self, items: list[tuple[str, str]], outcome: str) -> None:
        """Terminal rows (key, part) whose part is gone or corrupt: back to pending, to be generated
        again (the lost run does not count as an attempt: losing a file is not the row's fault).
        A row no longer finished from that part (acknowledged again meanwhile) is left alone."""
        now = time.time()
        with self._tx():
            for key, part in items:
                n = self.db.execute("UPDATE rows SET state='pending', part=NULL, error_code=NULL, worker=NULL, "
                                    "running=0, lease_until=NULL, attempts=MAX(attempts-1, 0), updated_at=? "
                                    "WHERE key=? AND state IN ('done','error') AND part=?",
                                    (now, key, part)).rowcount
                if n:
                    self.db.execute("UPDATE attempts SET outcome=? WHERE id=(SELECT MAX(id) FROM attempts "
                                    "WHERE key=?)", (outcome, key))

    def _end_attempt(self, key: str, outcome: str, now: float, worker: Optional[str] = None,
                     part: Optional[str] = None, code: Optional[str] = None) -> None:
        sql = "UPDATE attempts SET ended_at=?, outcome=?, part=?, error_code=? WHERE key=? AND ended_at IS NULL"
        args: list = [now, outcome, part, code, key]
        if worker is not None:
            sql += " AND worker=?"
            args.append(worker)
        self.db.execute(sql, args)

    # ---- workers ---------------------------------------------------------------------------
    def worker_started(self, worker: str, pid: int, host: str) -> None:
        now = time.time()
        self.db.execute("INSERT OR REPLACE INTO workers(id, pid, host, started_at, heartbeat_at) VALUES (?,?,?,?,?)",
                        (worker, pid, host, now, now))

    def worker_progress(self, worker: str, rows: int, tokens: int) -> None:
        """Rows written and tokens generated so far (kept current, so a killed worker's work shows)."""
        self.db.execute("UPDATE workers SET rows=?, tokens=?, heartbeat_at=? WHERE id=?",
                        (rows, tokens, time.time(), worker))

    def worker_ended(self, worker: str, rows: int, tokens: int, wall_s: float, summary: dict,
                     stop: str = "finished") -> None:
        """`stop`: finished (nothing left to claim), deadline, interrupted (Ctrl-C/SIGTERM),
        storage (the folder could not be written), failed."""
        self.db.execute("UPDATE workers SET ended_at=?, rows=?, tokens=?, wall_s=?, summary=?, stop=? WHERE id=?",
                        (time.time(), rows, tokens, wall_s, json.dumps(summary, default=str), stop, worker))

    def expire_dead_workers(self, host: str, alive) -> int:
        """Rows held by workers that are gone go back to pending at once (instead of when the lease
        runs out), the claim not counted as an attempt. A worker on `host` whose process is gone
        (`alive(pid, started_at)` is False) died: rows running in its engine get one more crash,
        and it is marked `died`. A worker that ended (any host) holds nothing: its rows come back
        uncharged. Returns rows freed."""
        freed = 0
        dead = [w for w, pid, started in self.db.execute(
            "SELECT id, pid, started_at FROM workers WHERE host=? AND ended_at IS NULL", (host,)).fetchall()
            if not alive(pid, started)]
        ended = {w for (w,) in self.db.execute(
            "SELECT DISTINCT r.worker FROM rows r JOIN workers w ON w.id=r.worker "
            "WHERE r.state='leased' AND w.ended_at IS NOT NULL")}
        now = time.time()
        with self._tx():
            for w in dead:
                rows = self.db.execute("SELECT key, running FROM rows WHERE state='leased' AND worker=?",
                                       (w,)).fetchall()
                for key, running in rows:
                    self._charge(key, running, now)
                    self.db.execute("UPDATE rows SET state='pending', worker=NULL, lease_until=NULL, running=0, "
                                    "attempts=MAX(attempts-1, 0), crashes=crashes+?, updated_at=? WHERE key=?",
                                    (1 if running else 0, now, key))
                    self._end_attempt(key, "worker_died" if running else "worker_died_not_running", now, w)
                freed += len(rows)
                self.db.execute("UPDATE workers SET ended_at=?, stop='died' WHERE id=?", (now, w))
        for w in ended:
            freed += self.release_worker(w, "worker_ended")
        return freed

    def sessions(self) -> list[dict]:
        """Every worker session, oldest first. `wall_s` is set when it ended cleanly; `stop` says
        how it ended (finished, deadline, interrupted, storage, failed, died; None while running)."""
        cur = self.db.execute("SELECT id, pid, host, started_at, heartbeat_at, ended_at, rows, tokens, wall_s, "
                              "summary, stop FROM workers ORDER BY started_at")
        return [{"worker": w, "pid": pid, "host": host, "started_at": s, "heartbeat_at": hb, "ended_at": e,
                 "rows": r, "tokens": t, "wall_s": ws, "summary": json.loads(sm) if sm else None, "stop": stop}
                for w, pid, host, s, hb, e, r, t, ws, sm, stop in cur]

    # ---- reading ---------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Rows of the current manifest per state (pending, leased, done, error)."""
        out = {s: 0 for s in ("pending", "leased", "done", "error")}
        for state, n in self.db.execute("SELECT r.state, COUNT(*) FROM rows r JOIN manifest m ON m.key=r.key "
                                        "GROUP BY r.state"):
            out[state] = n
        return out

    def error_counts(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT r.error_code, COUNT(*) FROM rows r JOIN manifest m ON m.key=r.key "
                                    "WHERE r.state='error' GROUP BY r.error_code ORDER BY 1"))

    def leases(self) -> list[tuple[str, int, float]]:
        """(worker, rows it holds, earliest lease expiry) of every worker holding leases."""
        return self.db.execute("SELECT r.worker, COUNT(*), MIN(r.lease_until) FROM rows r JOIN manifest m "
                               "ON m.key=r.key WHERE r.state='leased' GROUP BY r.worker ORDER BY 1").fetchall()

    def crash_counts(self) -> dict[str, int]:
        """Manifest rows that were in flight when a worker died: how many (`rows`), the most crashes
        of one row (`max`), and rows retried after internal_error (`retried`)."""
        n, most, retried = self.db.execute(
            "SELECT SUM(r.crashes > 0), MAX(r.crashes), SUM(r.attempts > 1) FROM rows r "
            "JOIN manifest m ON m.key=r.key").fetchone()
        return {"rows": n or 0, "max": most or 0, "retried": retried or 0}

    def manifest(self) -> list[tuple[int, str, str, Optional[str], int]]:
        """(pos, key, state, part, attempts) of every manifest row, in input order."""
        return self.db.execute("SELECT m.pos, m.key, r.state, r.part, r.attempts FROM manifest m "
                               "JOIN rows r ON r.key=m.key ORDER BY m.pos").fetchall()

    def todo_payloads(self) -> list[dict]:
        """Payloads of the manifest rows still to generate (pending or leased): the progress budget."""
        return [json.loads(p) for (p,) in self.db.execute(
            "SELECT r.payload FROM rows r JOIN manifest m ON m.key=r.key WHERE r.state IN ('pending','leased')")]

    def attempts(self, key: Optional[str] = None) -> list[tuple]:
        """The processing record: (key, attempt, worker, claimed_at, ended_at, outcome, part, error_code)."""
        sql = "SELECT key, attempt, worker, claimed_at, ended_at, outcome, part, error_code FROM attempts"
        return self.db.execute(sql + (" WHERE key=? ORDER BY id" if key else " ORDER BY id"),
                               (key,) if key else ()).fetchall()

    def get_meta(self, k: str) -> Optional[str]:
        row = self.db.execute("SELECT v FROM meta WHERE k=?", (k,)).fetchone()
        return row[0] if row else None

    def set_meta(self, k: str, v: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(k, v) VALUES (?,?)", (k, v))


class _Tx:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb):
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        return False
