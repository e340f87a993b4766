"""Sharded jobs without a server: `queue.shards=N` splits the rows into N shards by row key, and each
shard's worker (`worker.shard=i`, or task i of a Slurm job array) generates its own rows into the shared
output folder.

A shard's only state is what it writes to that folder, every file by an atomic rename:

- its Parquet parts (`parts/`, as any worker's): what is done is derived from them on every start;
- `shards/shard-NNNNN.checkpoints.parquet`: its rows in flight (pipeline/checkpoints.py's records,
  checksums and fingerprints included), rewritten after each checkpoint;
- `shards/shard-NNNNN.done`: the completion marker (a rerun of the array skips that shard);
- `shards/array.json`: the array's size, so a run with another `queue.shards` is refused.

Inside the process the shard schedules its rows with a SQLite queue in a temporary folder on local
disk (TMPDIR), built afresh on each start and removed at the end: nothing like SQLite ever sits on the
shared (network) file system. `action=finalize` merges every shard's parts into results.parquet.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pyarrow.parquet as pq

from kvbatch.pipeline import checkpoints, job_identity, procs
from kvbatch.pipeline.config import Config, ConfigError
from kvbatch.pipeline.log import log
from kvbatch.pipeline.parts import fsync_dir, scan, temp_path, write_atomic
from kvbatch.pipeline.queue import Queue
from kvbatch.pipeline.queue_sqlite import SqliteStore

DIR = "shards"
ARRAY = "array.json"
SLURM_TASK = "SLURM_ARRAY_TASK_ID"  # Slurm's index of this task in its job array


def shard_of(key: str, shards: int) -> int:
    """The shard a row belongs to: a stable hash of its key (the same on every host, Python and run)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big") % shards


def row_shard(row, shards: int) -> int:
    """The shard of a queue row (pipeline/samples.py): a row's samples go with the input row (`group`),
    so its prompt is prefilled once."""
    return shard_of(row.payload.get("group") or row.key, shards)


def worker_prefix(i: int) -> str:
    """The start of shard i's worker ids, so of its part names (`part-shard<i>-...`)."""
    return f"shard{i}-"


def parts_of(i: int) -> str:
    """The glob of shard i's parts: what a shard reads back on start (never every shard's parts)."""
    return f"part-{worker_prefix(i)}*.parquet"


def index(cfg: Config) -> int:
    """This worker's shard: worker.shard, else Slurm's array task id; ConfigError when neither says."""
    n = cfg.queue.shards
    if cfg.worker.shard is not None:
        return cfg.worker.shard
    task = os.environ.get(SLURM_TASK)
    if task is None:
        raise ConfigError(f"queue.shards={n}: say which shard this worker generates: worker.shard=0 to {n - 1} "
                          f"(or run it as a Slurm array task: sbatch --array=0-{n - 1})")
    if not task.isdigit() or int(task) >= n:
        raise ConfigError(f"worker.shard: {SLURM_TASK}={task!r} is not a shard of queue.shards={n}: submit the "
                          f"array as --array=0-{n - 1}")
    return int(task)


@dataclass
class Array:
    """The shards' state in one output folder."""

    out_dir: Path
    shards: int
    identity: str  # the job's identity (pipeline/job_identity.py)

    @property
    def dir(self) -> Path:
        """The folder of the shards' markers and checkpoints."""
        return self.out_dir / DIR

    def marker(self, i: int) -> Path:
        """Shard i's completion marker."""
        return self.dir / f"shard-{i:05d}.done"

    def checkpoint_file(self, i: int) -> Path:
        """Shard i's checkpoints of its rows in flight."""
        return self.dir / f"shard-{i:05d}.checkpoints.parquet"

    def claim(self) -> None:
        """Record the array's size in the folder; ConfigError when it holds an array of another size."""
        path = self.dir / ARRAY
        have = read_size(self.out_dir)
        if have is not None and have != self.shards:
            raise ConfigError(f"queue.shards={self.shards}: {self.out_dir} holds the work of a {have}-shard array "
                              f"(its rows are assigned to {have} shards); use queue.shards={have}, or a new output.dir")
        if have is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_text(path, json.dumps({"shards": self.shards, "job": self.identity}))

    def complete(self, i: int) -> Optional[dict]:
        """Shard i's completion record (None: not complete, or the marker is of another job)."""
        try:
            record = json.loads(self.marker(i).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        ok = isinstance(record, dict) and record.get("job") == self.identity and record.get("shards") == self.shards
        return record if ok else None

    def mark_complete(self, i: int, counts: dict[str, int]) -> None:
        """Shard i generated every row it has: its marker written, its checkpoints removed."""
        record = {"job": self.identity, "shard": i, "shards": self.shards, "rows": sum(counts.values()),
                  "done": counts.get("done", 0), "error": counts.get("error", 0), "host": socket.gethostname(),
                  "finished_at": time.time()}
        write_text(self.marker(i), json.dumps(record))
        self.checkpoint_file(i).unlink(missing_ok=True)

    def save_checkpoints(self, i: int, q: Queue) -> None:
        """Copy the local queue's checkpoints to the folder (the whole file replaced at once)."""
        write_atomic(checkpoints.kept(q), self.checkpoint_file(i))

    def load_checkpoints(self, i: int, q: Queue) -> int:
        """Put shard i's checkpoints from the folder into its local queue; returns how many. An unreadable
        file is named in one line and its rows start over."""
        path = self.checkpoint_file(i)
        if not path.exists():
            return 0
        try:
            table = pq.read_table(path)
            return checkpoints.restore(q, table)
        except Exception as exc:  # noqa: BLE001 - ArrowInvalid, OSError, a missing column: the rows start over
            log.warning(f"kvbatch: warning: {path} cannot be read ({type(exc).__name__}); the rows it kept start over")
            return 0

    def kept_tokens(self, i: int) -> dict[str, int]:
        """{row key: tokens} kept in shard i's checkpoint file ({} when it has none or cannot be read)."""
        try:
            t = pq.read_table(self.checkpoint_file(i), columns=["key", "n"])
        except Exception:  # noqa: BLE001 - none, or unreadable: nothing kept
            return {}
        return dict(zip(t.column("key").to_pylist(), t.column("n").to_pylist()))


def read_size(out_dir: Path) -> Optional[int]:
    """The shards of the array whose work the folder holds (None: no sharded work there)."""
    try:
        return int(json.loads((Path(out_dir) / DIR / ARRAY).read_text(encoding="utf-8"))["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_text(path: Path, text: str) -> None:
    """Write a small text file durably and atomically (a temporary, fsynced, renamed)."""
    tmp = temp_path(path)
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


_LOCAL = "kvbatch-queue"  # local queue folders: kvbatch-queue~HOST~PID~LABEL...


@contextmanager
def local_queue(label: str, clock=None) -> Iterator[Queue]:
    """A fresh SQLite queue in a temporary folder on local disk (TMPDIR), removed afterwards; the folders
    of killed processes of this host are removed first. `clock`: see Queue."""
    base, host = Path(tempfile.gettempdir()), re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    for old in base.glob(f"{_LOCAL}~{host}~*"):
        pid = old.name.split("~")[2]
        if pid.isdigit() and not procs.alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_LOCAL}~{host}~{os.getpid()}~{label}-"))
    q = Queue(SqliteStore(tmp / "queue.sqlite"), clock)
    try:
        yield q
    finally:
        q.close()
        shutil.rmtree(tmp, ignore_errors=True)


def done_keys(out_dir: Path, identity: str) -> set[str]:
    """Row keys that have a result in the folder's parts (this job's parts only)."""
    good, _ = scan(out_dir / "parts")
    return {k for t in good.values() if job_identity.owns(identity, t.schema.metadata)
            for k in t.column("row_key").to_pylist()}


def status_lines(array: Array, rows: list, results: Optional[Path] = None) -> list[str]:
    """action=status of a sharded job: one line per shard (complete, how far, not started), then the total."""
    by_shard: dict[int, list[str]] = {}
    for r in rows:
        by_shard.setdefault(row_shard(r, array.shards), []).append(r.key)
    done = done_keys(array.out_dir, array.identity)
    lines = [f"shards: {array.shards} in {array.out_dir}"]
    complete = 0
    for i in range(array.shards):
        keys = by_shard.get(i, [])
        record = array.complete(i)
        if record is not None:
            complete += 1
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("finished_at", 0)))
            lines.append(f"shard {i}: complete, {len(keys)} rows ({record.get('error', 0)} with an error code), "
                         f"on {record.get('host')} at {when}")
            continue
        finished = sum(1 for k in keys if k in done)
        kept = {k: n for k, n in array.kept_tokens(i).items() if k not in done}
        state = "not started" if not finished and not kept else "in progress"
        line = f"shard {i}: {state}, {finished} of {len(keys)} rows done"
        if kept:
            line += f"; {len(kept)} rows keep {sum(kept.values())} tokens in checkpoints"
        lines.append(line)
    total = sum(len(v) for v in by_shard.values())
    finished_rows = sum(1 for r in rows if r.key in done)
    lines.append(f"complete: {complete} of {array.shards} shards, {finished_rows} of {total} rows done" +
                 (f"; results: {results}" if results is not None and results.exists() else
                  "; action=finalize merges them into results.parquet"))
    return lines

