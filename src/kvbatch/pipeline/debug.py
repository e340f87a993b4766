"""Testing-only crash points: make a worker die at an exact place, as `kill -9` would.

Not for production use. Set `KVBATCH_DEBUG_CRASH_AT` to one or more comma-separated specs:

- `POINT:N` - the N-th time this process reaches POINT, it kills itself with SIGKILL
  (no cleanup, no finally blocks, no atexit: the same as `kill -9` from outside);
- `POINT:N:pause` - instead, print `kvbatch-debug: paused at POINT N (pid PID)` on stderr
  and wait for a signal, so a test can `kill -9` the process from outside at that exact point
  (or send SIGTERM: the process goes on from there and handles it);
- `POINT:N:term` - instead, send this process SIGTERM and go on (a stop request arriving
  there: the worker's first-signal path; two such specs at one place: the second signal);
- `row:KEY` - kill the process every time row KEY starts its prefill (a row that kills
  its worker: exercises worker.isolate_after / worker.max_crashes).

POINTs: `prefill` (after a prefill chunk of a prompt that has more chunks to go),
`decode` (after a decode step), `part_tmp` (a part's temporary file is written and
fsynced, not yet renamed), `after_part_write` (a part is durable, its rows not yet
acknowledged), `after_ack` (a part's rows were just acknowledged).

The engine side is an EngineHooks (`hooks()`), given to every engine the worker builds.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional

from kvbatch.engine.hooks import EngineHooks

ENV = "KVBATCH_DEBUG_CRASH_AT"
POINTS = ("prefill", "decode", "part_tmp", "after_part_write", "after_ack")


@dataclass(frozen=True)
class Spec:
    """One parsed crash point: where, which arrival, kill or pause, and the row for row:KEY."""

    point: str
    n: int = 0  # the n-th time (1-based); 0 for row:KEY
    pause: bool = False
    row: Optional[str] = None
    term: bool = False


def parse(text: Optional[str]) -> list[Spec]:
    """Parse KVBATCH_DEBUG_CRASH_AT's comma-separated specs (ValueError on a malformed one)."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("row:"):
            out.append(Spec("row", row=item[4:]))
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3) or parts[0] not in POINTS or not parts[1].isdigit() or int(parts[1]) < 1 \
                or (len(parts) == 3 and parts[2] not in ("pause", "term")):
            raise ValueError(f"{ENV}={text!r}: use POINT:N[:pause|:term] (POINT one of {', '.join(POINTS)}) "
                             f"or row:KEY")
        mode = parts[2] if len(parts) == 3 else ""
        out.append(Spec(parts[0], int(parts[1]), mode == "pause", term=mode == "term"))
    return out


_specs = parse(os.environ.get(ENV))
_seen: dict[str, int] = {}


def active() -> bool:
    """Whether any crash point is set in this process."""
    return bool(_specs)


def _die(what: str, pause: bool) -> None:
    if pause:
        print(f"kvbatch-debug: paused at {what} (pid {os.getpid()})", file=sys.stderr, flush=True)
        signal.pause()  # until a signal with a handler (SIGTERM, Ctrl-C) comes; kill -9 ends it here
        return
    print(f"kvbatch-debug: killing myself at {what} (pid {os.getpid()})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def point(name: str) -> None:
    """Count one arrival at `name`; die there if a spec says so."""
    if not _specs:
        return
    _seen[name] = _seen.get(name, 0) + 1
    for s in _specs:
        if s.point == name and s.n == _seen[name]:
            if s.term:
                os.kill(os.getpid(), signal.SIGTERM)
                continue
            _die(f"{name} {s.n}", s.pause)


def row_starts(key: str) -> None:
    """Die (or pause) if a row:KEY spec names the row starting now."""
    for s in _specs:
        if s.point == "row" and s.row == key:
            _die(f"row {key}", s.pause)


class CrashHooks(EngineHooks):
    """The engine's crash points: a row's start, a prefill chunk with more to go, a decode step."""

    def on_row_start(self, key: str) -> None:
        """The row:KEY crash point."""
        row_starts(key)

    def on_prefill_chunk(self, key: str, done: int, total: int) -> None:
        """The `prefill` crash point, after a chunk with more of its prompt to go."""
        if done < total:
            point("prefill")

    def on_decode_step(self) -> None:
        """The `decode` crash point."""
        point("decode")


def hooks(nonfinite: Optional[tuple[str, int]] = None, device_fault_after: Optional[int] = None,
          eval_fault_at: Optional[int] = None) -> EngineHooks:
    """The hooks a worker's engines get: crash points only when KVBATCH_DEBUG_CRASH_AT is set."""
    return (CrashHooks if _specs else EngineHooks)(nonfinite=nonfinite, device_fault_after=device_fault_after,
                                                   eval_fault_at=eval_fault_at)
