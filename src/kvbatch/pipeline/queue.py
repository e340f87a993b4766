"""The row queue: the same semantics on two stores, SQLite (one file in the output folder, the
default) and PostgreSQL (`queue.url=postgresql://...`: workers on many hosts).

Rows are enqueued idempotently by row key and claimed with a lease (worker id +
expiry) that the worker renews while it works; a dead worker's rows come back when
their lease expires. A row becomes `done`/`error` only when its Parquet part is
durable (`ack` after the part is renamed into place). Every claim is recorded in
`attempts` (who, when, how it ended), so a test or `status` can tell who processed
what. Every statement below is the same on both stores (pipeline/queue_sqlite.py and
pipeline/queue_postgres.py differ only in connecting, transactions, schema, row locks, the
clock and the reconcile lock), and every table has a `job` column, so one PostgreSQL database
holds many jobs.

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
it go back to pending at once, without counting an attempt or a crash. Whether a worker that
did not end is alive is known from its process only on its own host (`expire_dead_workers`);
anywhere else its lease says it: rows whose lease expired are claimed again.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from kvbatch.pipeline.queue_sqlite import QueueUnreadable, SqliteStore

__all__ = ["Claimed", "Queue", "QueueUnreadable", "TERMINAL", "open_store"]

TERMINAL = ("done", "error")


def open_store(url: str, folder: Path, job: str):
    """The store `queue.url` names: empty -> <folder>/queue.sqlite; postgresql://... -> that database
    (the job's rows under `job`)."""
    if not url:
        return SqliteStore(Path(folder) / "queue.sqlite")
    from kvbatch.pipeline.queue_postgres import PostgresStore  # psycopg loads only for this store

    return PostgresStore(url, job)


def _retrying(method):
    """A transaction the database rolled back to break a deadlock (PostgreSQL) runs again: each
    method's writes are one transaction, so running it again is running it once. A connection the
    server dropped (a PostgreSQL restart) is opened again first, for a bounded time (the store's
    reconnect); no row is charged for the outage."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        for attempt in range(8):
            try:
                return method(self, *args, **kwargs)
            except self.s.transient:
                if attempt == 7:
                    raise
            except self.s.errors:
                if attempt == 7 or not self.s.lost():
                    raise
                self.s.reconnect()  # QueueUnreachable (one line) when the server stays away
    return wrapper


@dataclass
class Claimed:
    """A row a worker claimed: its key, input position, payload, attempt and crash counts."""

    key: str
    pos: int
    payload: dict
    attempt: int  # 1 for the first run; +1 per internal_error retry (crashes do not count)
    crashes: int = 0  # times a worker died while this row ran in its engine (this claim's previous holders)
    alone_crashes: int = 0  # ... of them while the row ran alone
    lost_tokens: int = 0  # tokens a worker that died (or was given up) made beyond the row's checkpoint


class Queue:
    """The queue's operations over one store (a path: the SQLite file there). `clock` replaces the
    store's clock (every lease, expiry and timestamp is taken from `now()`): tests inject one to move
    time by hand instead of sleeping past a lease."""

    def __init__(self, store: Any, clock: Optional[Callable[[], float]] = None):
        self.s = SqliteStore(store) if isinstance(store, (str, Path)) else store
        self.clock = clock
        self.job = self.s.job
        self.db = self.s.db  # the store's own connection (tests read SQLite files through it)

    @property
    def path(self) -> Optional[Path]:
        """The SQLite file (None for PostgreSQL)."""
        return getattr(self.s, "path", None)

    @property
    def where(self) -> str:
        """Where the queue is, for messages: the SQLite file, or the server (password hidden) and job."""
        return self.s.where

    @property
    def kind(self) -> str:
        """The store's kind: sqlite or postgresql."""
        return self.s.kind

    @property
    def storage_errors(self) -> tuple[type[BaseException], ...]:
        """The store's exception types: a failure of the queue's storage, never a row's."""
        return self.s.errors

    def reopen(self) -> "Queue":
        """Another connection to the same queue (the lease thread's own)."""
        return Queue(self.s.reopen(), self.clock)

    def close(self) -> None:
        """Close the store's connection."""
        self.s.close()

    def now(self) -> float:
        """The time leases are judged by (PostgreSQL: the server's clock, so every host agrees)."""
        return self.clock() if self.clock is not None else self.s.now()

    def exclusive(self):
        """The reconcile/finalize lock: the folder's lock file (SQLite), an advisory lock (PostgreSQL)."""
        return self.s.exclusive()

    def _x(self, sql: str, args=()):
        return self.s.execute(sql, args)

    def _tx(self):
        return self.s.tx()

    # ---- enqueue ---------------------------------------------------------------------------
    @_retrying
    def enqueue(self, rows: Iterable) -> int:
        """Add rows (InputRow-like: pos, key, payload) not seen before; the manifest becomes
        exactly these keys in this order. Returns how many rows were new. A row already queued
        takes the input's position and payload (see changed(): such rows are regenerated)."""
        now, j = self.now(), self.job
        items = [(j, r.key, r.pos, json.dumps(r.payload, ensure_ascii=False), now) for r in rows]
        with self._tx():
            before = self._x("SELECT COUNT(*) FROM rows WHERE job=?", (j,)).fetchone()[0]
            self._x("DELETE FROM manifest WHERE job=?", (j,))
            self.s.executemany(
                f"INSERT INTO rows(job, key, pos, payload, updated_at) VALUES (?,?,?,?,?) "
                f"ON CONFLICT {self.s.conflict['rows']} DO UPDATE SET pos=excluded.pos, payload=excluded.payload",
                items)
            self.s.executemany("INSERT INTO manifest(job, pos, key) VALUES (?,?,?)",
                               [(j, pos, key) for j, key, pos, _, _ in items])
            after = self._x("SELECT COUNT(*) FROM rows WHERE job=?", (j,)).fetchone()[0]
        return after - before

    def changed(self, rows: Iterable) -> list[str]:
        """Keys of rows already queued whose content (payload) differs from `rows` (an edited input)."""
        stored = {k: p for k, p in self._x("SELECT key, payload FROM rows WHERE job=?", (self.job,))}
        return [r.key for r in rows if r.key in stored and json.loads(stored[r.key]) != r.payload]

    def keys_with_error(self, code: str) -> list[str]:
        """Keys of the manifest rows that ended with error `code`."""
        return [k for (k,) in self._x("SELECT r.key FROM rows r JOIN manifest m ON m.job=r.job AND m.key=r.key "
                                      "WHERE r.job=? AND r.state='error' AND r.error_code=?", (self.job, code))]

    def error_keys(self, codes: list[str]) -> list[str]:
        """Manifest rows that ended with one of `codes` (every error code when empty), in input order."""
        where = f" AND r.error_code IN ({','.join('?' * len(codes))})" if codes else ""
        return [k for (k,) in self._x("SELECT r.key FROM rows r JOIN manifest m ON m.job=r.job AND m.key=r.key "
                                      f"WHERE r.job=? AND r.state='error'{where} ORDER BY m.pos",
                                      [self.job, *codes])]

    @_retrying
    def regenerate(self, keys: list[str], in_parts: list[tuple[str, str]], reason: str) -> None:
        """Rows to be generated again from scratch: pending, counters reset; every result they have
        (`in_parts`: (key, part) found on disk, and the row's acknowledged part) and whatever the
        worker holding one now writes is superseded, never taken again."""
        now, wanted, j = self.now(), set(keys), self.job
        with self._tx():
            for key, part in in_parts:
                if key in wanted:
                    self._x("INSERT INTO superseded(job, key, part, reason, at) VALUES (?,?,?,?,?)",
                            (j, key, part, reason, now))
            for key in sorted(keys):
                row = self._x("SELECT state, part, worker FROM rows WHERE job=? AND key=?", (j, key)).fetchone()
                if row is None:
                    continue
                state, part, worker = row
                if part:
                    self._x("INSERT INTO superseded(job, key, part, reason, at) VALUES (?,?,?,?,?)",
                            (j, key, part, reason, now))
                if state == "leased" and worker:
                    self._x("INSERT INTO superseded(job, key, worker, reason, at) VALUES (?,?,?,?,?)",
                            (j, key, worker, reason, now))
                    self._end_attempt(key, reason, now, worker)
                self._x("UPDATE rows SET state='pending', part=NULL, error_code=NULL, worker=NULL, lease_until=NULL, "
                        "running=0, attempts=0, crashes=0, alone_crashes=0, updated_at=? WHERE job=? AND key=?",
                        (now, j, key))
                self._x("UPDATE attempts SET outcome=? WHERE id=(SELECT MAX(id) FROM attempts WHERE job=? AND key=?) "
                        "AND ended_at IS NOT NULL", (reason, j, key))

    def superseded(self) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
        """({(key, part)}, {(key, worker)}): results that belong to older content or settings."""
        by_part, by_worker = set(), set()
        for key, part, worker in self._x("SELECT key, part, worker FROM superseded WHERE job=?", (self.job,)):
            (by_part.add((key, part)) if part else by_worker.add((key, worker)))
        return by_part, by_worker

    # ---- leases ----------------------------------------------------------------------------
    @_retrying
    def claim(self, worker: str, n: int, lease_s: float, idle: bool = True,
              isolate_after: Optional[int] = None, max_crashes: Optional[int] = None) -> list[Claimed]:
        """Lease up to n manifest rows that are pending or whose lease has expired, in input order.

        A row whose lease expired was held by a worker that died (or stopped renewing): its
        crash count goes up and that claim is not counted as an attempt. Rows with at least
        `isolate_after` crashes (and fewer than `max_crashes`) are claimed only alone, and only
        by an `idle` worker (nothing in flight): a row that kills its worker then takes no
        batch mates with it. Rows at `max_crashes` are claimed like any other (the worker ends
        them without running them). PostgreSQL: rows another claimer has locked are skipped, and
        a claim locks only the rows it may take (a page of at most what is still wanted), so
        workers claiming at once split the pending rows instead of one finding them all locked.
        A worker never takes its own rows for another's: whatever its clock says of their leases
        (a clock step), a row it holds is still in its hands, never claimed again or charged."""
        if n <= 0:
            return []
        now, j = self.now(), self.job
        out: list[Claimed] = []

        def alone(crashes: int) -> bool:
            return isolate_after is not None and crashes >= isolate_after and \
                (max_crashes is None or crashes < max_crashes)

        with self._tx():
            picked: list[tuple] = []
            after, full = -1, False
            while not full:
                page = self._x(
                    "SELECT r.key, r.pos, r.attempts, r.crashes, r.state, r.running, r.payload, r.alone_crashes, "
                    "r.generated - COALESCE(c.n, 0) FROM rows r JOIN manifest m ON m.job=r.job AND m.key=r.key "
                    "LEFT JOIN checkpoints c ON c.job=r.job AND c.key=r.key "
                    "WHERE r.job=? AND r.state IN ('pending','leased') "
                    "AND (r.state='pending' OR (r.lease_until < ? AND r.worker <> ?)) AND r.pos > ? "
                    "ORDER BY r.pos LIMIT ?" + self.s.lock_rows, (j, now, worker, after, n - len(picked))).fetchall()
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
            leases, records = [], []
            for key, pos, attempts, crashes, state, running, payload, alone_n, lost, solo in picked:
                if state == "leased":  # its holder stopped renewing: undo that claim's count, charge a crash
                    alone_n += self._charge(key, running, now)
                    self._end_attempt(key, "expired" if running else "expired_not_running", now)
                    attempts, crashes = attempts - 1, crashes + bool(running)
                leases.append((worker, now + lease_s, attempts + 1, crashes, now, j, key))
                records.append((j, key, attempts + 1, worker, now, int(solo)))
                out.append(Claimed(key, pos, json.loads(payload), attempts + 1, crashes, alone_n, max(lost, 0)))
            if leases:
                self.s.executemany("UPDATE rows SET state='leased', worker=?, lease_until=?, attempts=?, crashes=?, "
                                   "running=0, generated=0, updated_at=? WHERE job=? AND key=?", leases)
                self.s.executemany("INSERT INTO attempts(job, key, attempt, worker, claimed_at, alone) "
                                   "VALUES (?,?,?,?,?,?)", records)
            self._x("UPDATE workers SET heartbeat_at=? WHERE job=? AND id=?", (now, j, worker))
        return out

    def _charge(self, key: str, running: int, now: float) -> int:
        """The worker holding `key` died: one more alone crash when the row ran alone in its engine
        (returns 1 then, else 0)."""
        if running and self._x("SELECT alone FROM attempts WHERE job=? AND key=? AND ended_at IS NULL "
                               "ORDER BY id DESC LIMIT 1", (self.job, key)).fetchone() == (1,):
            self._x("UPDATE rows SET alone_crashes=alone_crashes+1, updated_at=? WHERE job=? AND key=?",
                    (now, self.job, key))
            return 1
        return 0

    @_retrying
    def mark_running(self, worker: str, keys: list[str], running: bool) -> None:
        """Rows this worker handed to its engine (True) or that finished there (False): a crash is
        charged only to rows running at the time."""
        if not keys:
            return
        with self._tx():
            self.s.executemany("UPDATE rows SET running=? WHERE job=? AND key=? AND state='leased' AND worker=?",
                               [(int(running), self.job, k, worker) for k in sorted(keys)])

    @_retrying
    def release_worker(self, worker: str, outcome: str) -> int:
        """Every row this worker still holds goes back to pending, its attempt not counted (the
        worker is ending: finished rows whose part was not written are generated again)."""
        now, j = self.now(), self.job
        with self._tx():
            keys = sorted(k for (k,) in self._x("SELECT key FROM rows WHERE job=? AND state='leased' AND worker=?",
                                                (j, worker)))
            for key in keys:
                self._x("UPDATE rows SET state='pending', worker=NULL, lease_until=NULL, running=0, "
                        "attempts=CASE WHEN attempts > 0 THEN attempts-1 ELSE 0 END, updated_at=? "
                        "WHERE job=? AND key=?", (now, j, key))
                self._end_attempt(key, outcome, now, worker)
        return len(keys)

    @_retrying
    def renew(self, worker: str, lease_s: float, generated: Optional[dict[str, int]] = None) -> int:
        """Extend every lease this worker holds; returns how many rows it still holds. (The worker's
        heartbeat too: status and other hosts see it is alive.) `generated`: the output tokens its rows
        in flight hold now (key -> count), recorded with their leases: if the worker dies, the worker
        that claims a row next counts the tokens beyond its checkpoint as lost (claim)."""
        now, j = self.now(), self.job
        with self._tx():
            n = self._x("UPDATE rows SET lease_until=? WHERE job=? AND state='leased' AND worker=?",
                        (now + lease_s, j, worker)).rowcount
            if generated:
                self.s.executemany("UPDATE rows SET generated=? WHERE job=? AND key=? AND state='leased' AND worker=?",
                                   [(int(c), j, k, worker) for k, c in sorted(generated.items())])
            self._x("UPDATE workers SET heartbeat_at=? WHERE job=? AND id=?", (now, j, worker))
        return n

    @_retrying
    def ack(self, worker: str, items: list[tuple[str, Optional[str]]], part: str) -> None:
        """Rows (key, error_code) whose results are durable in `part`: done (ok) or error.
        A row already terminal stays as it is (it was acknowledged from another part)."""
        now, j = self.now(), self.job
        items = sorted(items, key=lambda kv: kv[0])  # one lock order for every writer
        with self._tx():
            self.s.executemany(
                "UPDATE rows SET state=?, part=?, error_code=?, worker=?, lease_until=NULL, running=0, generated=0, "
                "updated_at=? WHERE job=? AND key=? AND state NOT IN ('done','error') AND NOT EXISTS "
                "(SELECT 1 FROM superseded s WHERE s.job=rows.job AND s.key=rows.key AND s.worker=?)",
                [("error" if code else "done", part, code, worker, now, j, key, worker) for key, code in items])
            self.s.executemany(
                "UPDATE attempts SET ended_at=?, outcome=?, part=?, error_code=? "
                "WHERE job=? AND key=? AND ended_at IS NULL AND worker=?",
                [(now, "error" if code else "done", part, code, j, key, worker) for key, code in items])

    @_retrying
    def adopt(self, items: list[tuple[str, Optional[str], str]], part: str) -> None:
        """Rows (key, error_code, writer) found durable in `part` but never acknowledged (their
        writer died between the rename and the ack): finished from that part, and the writer's
        attempt is closed as if it had acknowledged them."""
        now, j = self.now(), self.job
        with self._tx():
            for key, code, writer in sorted(items, key=lambda x: x[0]):
                self._x("UPDATE rows SET state=?, part=?, error_code=?, worker=?, lease_until=NULL, running=0, "
                        "generated=0, updated_at=? WHERE job=? AND key=? AND state NOT IN ('done','error')",
                        ("error" if code else "done", part, code, writer, now, j, key))
                self._end_attempt(key, "error" if code else "done", now, writer, part, code)

    @_retrying
    def release(self, worker: str, keys: list[str], outcome: str, count_attempt: bool = True) -> None:
        """Give leased rows back (retry, deadline, shutdown); `count_attempt=False` undoes the claim's count.
        (The worker counted their lost tokens itself: their recorded count goes.)"""
        now, j = self.now(), self.job
        with self._tx():
            for key in sorted(keys):
                self._x("UPDATE rows SET state='pending', worker=NULL, lease_until=NULL, running=0, generated=0, "
                        "updated_at=?, "
                        "attempts=attempts-? WHERE job=? AND key=? AND state='leased' AND worker=?",
                        (now, 0 if count_attempt else 1, j, key, worker))
                self._end_attempt(key, outcome, now, worker)

    @_retrying
    def requeue(self, items: list[tuple[str, str]], outcome: str) -> None:
        """Terminal rows (key, part) whose part is gone or corrupt: back to pending, to be generated
        again (the lost run does not count as an attempt: losing a file is not the row's fault).
        A row no longer finished from that part (acknowledged again meanwhile) is left alone."""
        now, j = self.now(), self.job
        with self._tx():
            for key, part in sorted(items):
                n = self._x("UPDATE rows SET state='pending', part=NULL, error_code=NULL, worker=NULL, running=0, "
                            "lease_until=NULL, attempts=CASE WHEN attempts > 0 THEN attempts-1 ELSE 0 END, "
                            "updated_at=? WHERE job=? AND key=? AND state IN ('done','error') AND part=?",
                            (now, j, key, part)).rowcount
                if n:
                    self._x("UPDATE attempts SET outcome=? WHERE id=(SELECT MAX(id) FROM attempts "
                            "WHERE job=? AND key=?)", (outcome, j, key))

    def _end_attempt(self, key: str, outcome: str, now: float, worker: Optional[str] = None,
                     part: Optional[str] = None, code: Optional[str] = None) -> None:
        sql = ("UPDATE attempts SET ended_at=?, outcome=?, part=?, error_code=? "
               "WHERE job=? AND key=? AND ended_at IS NULL")
        args: list = [now, outcome, part, code, self.job, key]
        if worker is not None:
            sql += " AND worker=?"
            args.append(worker)
        self._x(sql, args)

    # ---- workers ---------------------------------------------------------------------------
    @_retrying
    def worker_started(self, worker: str, pid: int, host: str) -> None:
        """Register this worker (pid, host, heartbeat), replacing any earlier record of its id."""
        now, j = self.now(), self.job
        with self._tx():
            self._x("DELETE FROM workers WHERE job=? AND id=?", (j, worker))
            self._x("INSERT INTO workers(job, id, pid, host, started_at, heartbeat_at) VALUES (?,?,?,?,?,?)",
                    (j, worker, pid, host, now, now))

    @_retrying
    def worker_progress(self, worker: str, rows: int, tokens: int) -> None:
        """Rows written and tokens generated so far (kept current, so a killed worker's work shows)."""
        self._x("UPDATE workers SET rows=?, tokens=?, heartbeat_at=? WHERE job=? AND id=?",
                (rows, tokens, self.now(), self.job, worker))

    @_retrying
    def worker_ended(self, worker: str, rows: int, tokens: int, wall_s: float, summary: dict,
                     stop: str = "finished") -> None:
        """`stop`: finished (nothing left to claim), deadline, interrupted (Ctrl-C/SIGTERM),
        storage (the folder could not be written), failed."""
        self._x("UPDATE workers SET ended_at=?, rows=?, tokens=?, wall_s=?, summary=?, stop=? WHERE job=? AND id=?",
                (self.now(), rows, tokens, wall_s, json.dumps(summary, default=str), stop, self.job, worker))

    @_retrying
    def expire_dead_workers(self, host: str, alive) -> int:
        """Rows held by workers that are gone go back to pending at once (instead of when the lease
        runs out), the claim not counted as an attempt. A worker on `host` whose process is gone
        (`alive(pid, started_at)` is False) died: rows running in its engine get one more crash,
        and it is marked `died`. A worker that ended (any host) holds nothing: its rows come back
        uncharged. Workers on other hosts are judged by their leases alone (see claim). Returns
        rows freed."""
        freed, j = 0, self.job
        dead = [w for w, pid, started in self._x(
            "SELECT id, pid, started_at FROM workers WHERE job=? AND host=? AND ended_at IS NULL",
            (j, host)).fetchall() if not alive(pid, started)]
        ended = sorted(w for (w,) in self._x(
            "SELECT DISTINCT r.worker FROM rows r JOIN workers w ON w.job=r.job AND w.id=r.worker "
            "WHERE r.job=? AND r.state='leased' AND w.ended_at IS NOT NULL", (j,)))
        now = self.now()
        with self._tx():
            for w in dead:
                rows = sorted(self._x("SELECT key, running FROM rows WHERE job=? AND state='leased' AND worker=?",
                                      (j, w)).fetchall())
                for key, running in rows:
                    self._charge(key, running, now)
                    self._x("UPDATE rows SET state='pending', worker=NULL, lease_until=NULL, running=0, "
                            "attempts=CASE WHEN attempts > 0 THEN attempts-1 ELSE 0 END, crashes=crashes+?, "
                            "updated_at=? WHERE job=? AND key=?", (1 if running else 0, now, j, key))
                    self._end_attempt(key, "worker_died" if running else "worker_died_not_running", now, w)
                freed += len(rows)
                self._x("UPDATE workers SET ended_at=?, stop='died' WHERE job=? AND id=?", (now, j, w))
        for w in ended:
            freed += self.release_worker(w, "worker_ended")
        return freed

    def leased_elsewhere(self, host: str) -> Optional[float]:
        """The earliest lease expiry of rows held by live-registered workers on other hosts (None:
        none): a worker with nothing to claim waits for those, since only their leases can tell
        whether their holders are alive."""
        row = self._x("SELECT MIN(r.lease_until) FROM rows r JOIN manifest m ON m.job=r.job AND m.key=r.key "
                      "JOIN workers w ON w.job=r.job AND w.id=r.worker "
                      "WHERE r.job=? AND r.state='leased' AND w.ended_at IS NULL AND w.host<>?",
                      (self.job, host)).fetchone()
        return row[0] if row else None

    def sessions(self) -> list[dict]:
        """Every worker session, oldest first. `wall_s` is set when it ended cleanly; `stop` says
        how it ended (finished, deadline, interrupted, storage, failed, died; None while running)."""
        cur = self._x("SELECT id, pid, host, started_at, heartbeat_at, ended_at, rows, tokens, wall_s, "
                      "summary, stop FROM workers WHERE job=? ORDER BY started_at", (self.job,))
        return [{"worker": w, "pid": pid, "host": host, "started_at": s, "heartbeat_at": hb, "ended_at": e,
                 "rows": r, "tokens": t, "wall_s": ws, "summary": json.loads(sm) if sm else None, "stop": stop}
                for w, pid, host, s, hb, e, r, t, ws, sm, stop in cur.fetchall()]

    # ---- reading ---------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Rows of the current manifest per state (pending, leased, done, error)."""
        out = {s: 0 for s in ("pending", "leased", "done", "error")}
        for state, n in self._x("SELECT r.state, COUNT(*) FROM rows r JOIN manifest m ON m.job=r.job AND m.key=r.key "
                                "WHERE r.job=? GROUP BY r.state", (self.job,)):
            out[state] = int(n)
        return out

    def error_counts(self) -> dict[str, int]:
        """Finished error rows of the manifest by error code."""
        return {c: int(n) for c, n in self._x(
            "SELECT r.error_code, COUNT(*) FROM rows r JOIN manifest m ON m.job=r.job AND m.key=r.key "
            "WHERE r.job=? AND r.state='error' GROUP BY r.error_code ORDER BY 1", (self.job,))}

    def leases(self) -> list[tuple[str, int, float]]:
        """(worker, rows it holds, earliest lease expiry) of every worker holding leases."""
        return [(w, int(n), t) for w, n, t in self._x(
            "SELECT r.worker, COUNT(*), MIN(r.lease_until) FROM rows r JOIN manifest m ON m.job=r.job "
            "AND m.key=r.key WHERE r.job=? AND r.state='leased' GROUP BY r.worker ORDER BY 1", (self.job,))]

    def crash_counts(self) -> dict[str, int]:
        """Manifest rows that were in flight when a worker died: how many (`rows`), the most crashes
        of one row (`max`), and rows retried after internal_error (`retried`)."""
        n, most, retried = self._x(
            "SELECT SUM(CASE WHEN r.crashes > 0 THEN 1 ELSE 0 END), MAX(r.crashes), "
            "SUM(CASE WHEN r.attempts > 1 THEN 1 ELSE 0 END) FROM rows r "
            "JOIN manifest m ON m.job=r.job AND m.key=r.key WHERE r.job=?", (self.job,)).fetchone()
        return {"rows": int(n or 0), "max": int(most or 0), "retried": int(retried or 0)}

    def manifest(self) -> list[tuple[int, str, str, Optional[str], int]]:
        """(pos, key, state, part, attempts) of every manifest row, in input order."""
        return [tuple(r) for r in self._x(
            "SELECT m.pos, m.key, r.state, r.part, r.attempts FROM manifest m "
            "JOIN rows r ON r.job=m.job AND r.key=m.key WHERE m.job=? ORDER BY m.pos", (self.job,)).fetchall()]

    def fingerprint(self) -> list:
        """A digest of the job's rows as reconcile and finalize see them (manifest, states, every change's
        time, superseded results): equal while nothing in the queue changed."""
        row = self._x("SELECT COUNT(*), SUM(m.pos), SUM(LENGTH(m.key)), MAX(r.updated_at), "
                      "SUM(CASE WHEN r.state IN ('done','error') THEN 1 ELSE 0 END) FROM manifest m "
                      "JOIN rows r ON r.job=m.job AND r.key=m.key WHERE m.job=?", (self.job,)).fetchone()
        stale = self._x("SELECT COUNT(*) FROM superseded WHERE job=?", (self.job,)).fetchone()
        return [None if v is None else float(v) for v in (*row, *stale)]

    def manifest_rows(self) -> Iterator[tuple]:
        """manifest()'s rows one at a time (a million rows are never one list of tuples)."""
        cur = self._x("SELECT m.pos, m.key, r.state, r.part, r.attempts FROM manifest m "
                      "JOIN rows r ON r.job=m.job AND r.key=m.key WHERE m.job=? ORDER BY m.pos", (self.job,))
        while rows := cur.fetchmany(10000):
            yield from rows

    def todo_payloads(self) -> list[dict]:
        """Payloads of the manifest rows still to generate (pending or leased): the progress budget."""
        return [json.loads(p) for (p,) in self._x(
            "SELECT r.payload FROM rows r JOIN manifest m ON m.job=r.job AND m.key=r.key "
            "WHERE r.job=? AND r.state IN ('pending','leased')", (self.job,))]

    def attempts(self, key: Optional[str] = None) -> list[tuple]:
        """The processing record: (key, attempt, worker, claimed_at, ended_at, outcome, part, error_code)."""
        sql = "SELECT key, attempt, worker, claimed_at, ended_at, outcome, part, error_code FROM attempts WHERE job=?"
        return [tuple(r) for r in self._x(sql + (" AND key=? ORDER BY id" if key else " ORDER BY id"),
                                          (self.job, key) if key else (self.job,)).fetchall()]

    def get_meta(self, k: str) -> Optional[str]:
        """The job's metadata value `k`, or None."""
        row = self._x("SELECT v FROM meta WHERE job=? AND k=?", (self.job, k)).fetchone()
        return row[0] if row else None

    def set_meta(self, k: str, v: str) -> None:
        """Set the job's metadata value `k`."""
        self._x(f"INSERT INTO meta(job, k, v) VALUES (?,?,?) ON CONFLICT {self.s.conflict['meta']} "
                "DO UPDATE SET v=excluded.v", (self.job, k, v))

    def jobs_named(self, name: str) -> list[str]:
        """Ids of the jobs in this store enqueued under job.name `name` (ids are NAME/CONFIG_HASH)."""
        prefix = f"{name}/"
        return [j for (j,) in self._x("SELECT job FROM meta WHERE k='config_hash' AND substr(job, 1, ?) = ? "
                                      "ORDER BY job", (len(prefix), prefix))]

    def has_job(self) -> bool:
        """Whether this store holds the job (it was enqueued)."""
        return self.get_meta("config_hash") is not None or \
            self._x("SELECT 1 FROM rows WHERE job=? LIMIT 1", (self.job,)).fetchone() is not None
