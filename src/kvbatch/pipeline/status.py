"""`action=status`: what the queue holds, who is working on it, how fast the last run went.

Reads the queue only (never loads the model, never changes anything). Lines:

    queue: <path, or the database (password hidden) and job id>
    rows: <total> total; pending P, leased L, done D, error E
    errors: <code> N, ...                      (only when some rows ended with an error code)
    remaining: N rows (P pending, L leased)    or "remaining: none (every row has a result)"
    workers on <host>: <id> running|died|silent (pid P, N rows leased, heartbeat Ns ago, X rows/s); ...
             (unended sessions, one line per host; "died": its process is gone (judged on its own host
             only), its rows return at the next action=work/run; "silent": no heartbeat for longer than
             worker.lease_s, so its leases have run out and any worker takes its rows)
    crashes: N rows were in flight when a worker died (one row up to Kx; alone from A, given up at M)
    retries: N rows were retried after internal_error
    in progress: N rows keep T tokens in checkpoints (KEY n, ...)   (rows not finished that continue from them)
    started over: N rows whose checkpoint could not be used (corrupt K, config changed C, ...)
    last run: <worker> <stop>, R rows, T tokens in S s (X rows/s, Y tokens/s)
    runs: N worker sessions (finished F, deadline D, interrupted I, died K, running R)
"""
from __future__ import annotations

import socket
from typing import Optional

from kvbatch.pipeline import checkpoints, procs
from kvbatch.pipeline.queue import Queue

STOPS = ("finished", "deadline", "interrupted", "failed", "died")


def _session_wall(s: dict) -> Optional[float]:
    """A session's working time: measured when it ended cleanly, else up to its last heartbeat."""
    if s["wall_s"]:
        return s["wall_s"]
    end = s["ended_at"] if s["stop"] != "died" else s["heartbeat_at"]
    end = end or s["heartbeat_at"]
    return (end - s["started_at"]) if end and s["started_at"] and end > s["started_at"] else None


def _gone(s: dict, host: str) -> bool:
    """A worker on this host whose process no longer runs (killed; its rows return at the next work)."""
    if s["host"] != host or not s["pid"]:
        return False  # another host's worker: not ours to judge
    return not procs.alive(s["pid"], s["started_at"] or 0)


def _rate(s: dict) -> str:
    wall = _session_wall(s)
    return f", {s['rows'] / wall:.2f} rows/s" if wall else ""


def _workers(running: list[dict], held: dict, now: float, lease_s: float, host: str) -> list[str]:
    """One line per host: its unended workers, their leases, heartbeat age and rows/s."""
    by_host: dict[str, list[str]] = {}
    for s in running:
        age = max(now - (s["heartbeat_at"] or now), 0)
        state = "died" if _gone(s, host) else "silent" if age > lease_s else "running"
        by_host.setdefault(s["host"] or "?", []).append(
            f"{s['worker']} {state} (pid {s['pid']}, {held.get(s['worker'], (0, 0))[0]} rows leased, "
            f"heartbeat {age:.0f}s ago{_rate(s)})")
    return [f"workers on {h}: " + "; ".join(ws) for h, ws in sorted(by_host.items())]


def lines(q: Queue, isolate_after: int, max_crashes: int, lease_s: float = 600.0, host: Optional[str] = None,
          now: Optional[float] = None) -> list[str]:
    """The status lines of the queue `q` (read only). `host`: this machine's name in the queue."""
    now = now or q.now()
    host = host or socket.gethostname()
    c, errs = q.counts(), q.error_counts()
    out = [f"queue: {q.where}",
           f"rows: {sum(c.values())} total; " + ", ".join(f"{k} {v}" for k, v in c.items())]
    if errs:
        out.append("errors: " + ", ".join(f"{k or 'unknown'} {v}" for k, v in errs.items()))
    left = c["pending"] + c["leased"]
    out.append(f"remaining: {left} rows ({c['pending']} pending, {c['leased']} leased)" if left
               else "remaining: none (every row has a result)")
    sessions = q.sessions()
    held = {w: (n, until) for w, n, until in q.leases()}
    running = [s for s in sessions if s["ended_at"] is None]
    out.extend(_workers(running, held, now, lease_s, host))
    cr = q.crash_counts()
    if cr["rows"]:
        out.append(f"crashes: {cr['rows']} rows were in flight when a worker died (one row up to {cr['max']}x; "
                   f"a row runs alone from {isolate_after}, is given up at {max_crashes})")
    if cr["retried"]:
        out.append(f"retries: {cr['retried']} rows were retried after internal_error")
    kept = checkpoints.in_progress(q)
    if kept:
        some = ", ".join(f"{k} {n}" for k, n in kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        out.append(f"in progress: {len(kept)} rows keep {sum(n for _, n in kept)} tokens in checkpoints ({some})")
    over = checkpoints.started_over(q)
    if over:
        out.append(f"started over: {sum(over.values())} rows whose checkpoint could not be used ("
                   + ", ".join(f"{why} {n}" for why, n in over.items()) + ")")
    done = [s for s in sessions if s["ended_at"] is not None]
    if done:
        last = max(done, key=lambda s: s["started_at"] or 0)
        wall = _session_wall(last)
        speed = (f" ({last['rows'] / wall:.2f} rows/s, {last['tokens'] / wall:.1f} tokens/s)"
                 if wall else "")
        out.append(f"last run: {last['worker']} {last['stop'] or 'ended'}, {last['rows']} rows, "
                   f"{last['tokens']} tokens in {wall or 0:.1f}s{speed}")
    if sessions:
        gone = [s for s in running if _gone(s, host)]  # killed; marked died at the next action=work/run
        by = {k: sum(1 for s in done if s["stop"] == k) for k in STOPS}
        by["died"] += len(gone)
        live = len(running) - len(gone)
        parts = [f"{k} {v}" for k, v in by.items() if v] + ([f"running {live}"] if live else [])
        out.append(f"runs: {len(sessions)} worker sessions ({', '.join(parts)})")
    return out
