"""Is a recorded process still running? The one answer for the queue's dead-worker check,
`action=status`, the sweep report and stale temporary files.

A pid alone can be reused by a later process; with `started_at` (the epoch time the
process recorded when it started) a process that began after it is not the same one.
A process on another host cannot be seen from here: with `host=` given and not this
host, `alive` says False (callers decide what "unknown" means for them).
"""
from __future__ import annotations

import os
import socket
from typing import Optional

import psutil

# Process creation times come from the OS with ~10 ms resolution; the recorded start is
# taken a little later, in Python: allow this much before calling it another process.
_SLACK_S = 1.0


def alive(pid: Optional[int], started_at: Optional[float] = None, host: Optional[str] = None) -> bool:
    """True while process `pid` (started at `started_at`, on `host`) is running here."""
    if not pid or (host is not None and host != socket.gethostname()):
        return False
    try:
        proc = psutil.Process(int(pid))
        return started_at is None or proc.create_time() <= started_at + _SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's process with this pid: it exists
        return started_at is None


def is_me(pid: Optional[int]) -> bool:
    """Whether `pid` is this process."""
    return pid == os.getpid()
