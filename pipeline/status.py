"""`action=status`: what the queue holds, who is working on it, how fast the last run went.

Reads the queue only (never loads the model, never changes anything). Lines:

    queue: <path>
    rows: <total> total; pending P, leased L, done D, error E
    errors: <code> N, ...                      (only when some rows ended with an error code)
    remaining: N rows (P pending, L leased)    or "remaining: none (every row has a result)"
    workers: <id> running|died (pid P on H, N rows leased, heartbeat Ns ago); ...   (unended sessions;
             "died": its process is gone, its rows return to the queue at the next action=work/run)
    crashes: N rows were in flight when a worker died (one row up to Kx; alone from A, given up at M)
    retries: N rows were retried after internal_error
    last run: <worker> <stop>, R rows, T tokens in S s (X rows/s, Y tokens/s)
    runs: N worker sessions (finished F, deadline D, interrupted I, died K, running R)
"""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Optional

from kvbatch.pipeline import procs
from kvbatch.pipeline.queue import Queue

STOPS = ("finished", "deadline", "interrupted", "failed", "died")


def _session_wall(s: dict) -> Optional[float]:
    """A session's working time: measured when it ended cleanly, else up to its last heartbeat."""
    if s["wall_s"]:
        return s["wall_s"]
    end = s["ended_at"] if s["stop"] != "died" else s["heartbeat_at"]
    end = end or s["heartbeat_at"]
    return (end - s["started_at"]) if end and s["started_at"] and end > s["started_at"] else None


def _gone(s: dict) -> bool:
    """A worker on this host whose process no longer runs (killed; its rows return at the next work)."""
    if s["host"] != socket.gethostname() or not s["pid"]:
        return False  # another host's worker: not ours to judge
    return not procs.alive(s["pid"], s["started_at"] or 0)


def lines(queue_path: Path, isolate_after: int, max_crashes: int, now: Optional[float] = None) -> list[str]:
    now = now or time.time()
    q = Queue(queue_path)
    try:
        c, errs = q.counts(), q.error_counts()
        out = [f"queue: {queue_path}",
               f"rows: {sum(c.values())} total; " + ", ".join(f"{k} {v}" for k, v in c.items())]
        if errs:
            out.append("errors: " + ", ".join(f"{k or 'unknown'} {v}" for k, v in errs.items()))
        left = c["pending"] + c["leased"]
        out.append(f"remaining: {left} rows ({c['pending']} pending, {c['leased']} leased)" if left
                   else "remaining: none (every row has a result)")
        sessions = q.sessions()
        held = {w: (n, until) for w, n, until in q.leases()}
        running = [s for s in sessions if s["ended_at"] is None]
        if running:
            out.append("workers: " + "; ".join(
                f"{s['worker']} {'died' if _gone(s) else 'running'} (pid {s['pid']} on {s['host']}, "
                f"{held.get(s['worker'], (0, 0))[0]} rows leased, heartbeat "
                f"{max(now - (s['heartbeat_at'] or now), 0):.0f}s ago)" for s in running))
        cr = q.crash_counts()
        if cr["rows"]:
            out.append(f"crashes: {cr['rows']} rows were in flight when a worker died (one row up to {cr['max']}x; "
                       f"a row runs alone from {isolate_after}, is given up at {max_crashes})")
        if cr["retried"]:
            out.append(f"retries: {cr['retried']} rows were retried after internal_error")
        done = [s for s in sessions if s["ended_at"] is not None]
        if done:
            last = max(done, key=lambda s: s["started_at"] or 0)
            wall = _session_wall(last)
            speed = (f" ({last['rows'] / wall:.2f} rows/s, {last['tokens'] / wall:.1f} tokens/s)"
                     if wall else "")
            out.append(f"last run: {last['worker']} {last['stop'] or 'ended'}, {last['rows']} rows, "
                       f"{last['tokens']} tokens in {wall or 0:.1f}s{speed}")
        if sessions:
            gone = [s for s in running if _gone(s)]  # killed; marked died at the next action=work/run
            by = {k: sum(1 for s in done if s["stop"] == k) for k in STOPS}
            by["died"] += len(gone)
            live = len(running) - len(gone)
            parts = [f"{k} {v}" for k, v in by.items() if v] + ([f"running {live}"] if live else [])
            out.append(f"runs: {len(sessions)} worker sessions ({', '.join(parts)})")
        return out
    finally:
        q.close()
