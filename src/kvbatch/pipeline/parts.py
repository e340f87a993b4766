"""Parquet parts: the durable unit of work (rows of the results schema, pipeline/results.py).

A part is written to a hidden temporary name (`.NAME~HOST~PID.tmp`, unique per
process), flushed and fsynced, then renamed into place (and the directory
fsynced), so a crash never leaves a half-written file under a part's name; a
temporary left by a dead process is removed by the next reconcile. Each part records its row count and a hash of its row
keys in its metadata, and pages carry checksums: `read_part` verifies all three,
so a truncated or corrupt part is detected instead of silently dropping rows.
"""
from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from pathlib import Path
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from kvbatch.pipeline import job_identity, procs
from kvbatch.pipeline.results import SCHEMA, ResultRecord, to_table

PART_GLOB = "part-*.parquet"
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())


class PartError(Exception):
    """A part file that cannot be trusted (truncated, corrupt, or not what its metadata says)."""


def keys_digest(keys: list[str]) -> str:
    """A digest of a part's row keys in order, to check a part against the queue's record."""
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename in it is durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return  # not supported on this platform
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """A hidden temporary next to `path`, unique to this process (host and pid in its name)."""
    return path.with_name(f".{path.name}~{_HOST}~{os.getpid()}.tmp")


def write_atomic(table: pa.Table, path: Path, before_rename: Optional[Callable[[], None]] = None) -> Path:
    """Write `table` to `path` so that `path` is either absent or complete and durable."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="zstd", write_page_checksum=True)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:  # a full disk: give its space back at once (the queue still has to be written)
        tmp.unlink(missing_ok=True)
        raise
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def part_name(worker: str, seq: int) -> str:
    """A part's file name: the worker id made file-safe and its sequence number."""
    return f"part-{re.sub(r'[^A-Za-z0-9_.-]', '_', worker)}-{seq:05d}.parquet"


def write_part(parts_dir: Path, name: str, records: list[ResultRecord],
               before_rename: Optional[Callable[[], None]] = None, job: Optional[str] = None) -> Path:
    """A durable part holding `records`; `job`: the identity of the job it belongs to (pipeline/job_identity.py)."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    keys = [r.row_key for r in records]
    meta = {"kvbatch.part.rows": str(len(records)), "kvbatch.part.keys_sha256": keys_digest(keys)}
    if job is not None:
        meta[job_identity.PART_KEY] = job
    return write_atomic(to_table(records, meta), parts_dir / name, before_rename)


def read_part(path: Path) -> pa.Table:
    """Read and verify one part; PartError when it cannot be trusted. Anything that fails while
    reading it (a corrupt footer can fail in Arrow, in decoding its names, anywhere) means the
    same: not a whole part, to be quarantined and its rows generated again."""
    try:
        return _verified(path)
    except PartError:
        raise
    except Exception as exc:  # noqa: BLE001 - ArrowInvalid, OSError, UnicodeDecodeError, ...
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PartError(f"{path.name}: unreadable ({type(exc).__name__}: {why})") from None


def read_table(path: Path, verify: bool = False) -> pa.Table:
    """One part's table, as written (`verify`: its pages' checksums checked). ParquetFile, not
    pq.read_table: the dataset reader keeps ~40 KB of memory per file read, which a scan of tens of
    thousands of parts would add up."""
    with pq.ParquetFile(path, page_checksum_verification=verify) as pf:
        return pf.read(use_threads=False)


def _verified(path: Path) -> pa.Table:
    table = read_table(path, verify=True)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    keys = table.column("row_key").to_pylist() if "row_key" in table.column_names else []
    if meta.get("kvbatch.part.rows") != str(table.num_rows) \
            or meta.get("kvbatch.part.keys_sha256") != keys_digest(keys):
        raise PartError(f"{path.name}: row count or row keys do not match its metadata")
    if table.schema.remove_metadata() != SCHEMA:
        raise PartError(f"{path.name}: schema differs from the results schema")
    return table


INDEX = ("row_key", "error_code", "worker")  # what reconcile needs of a part; finalize reads the rest


def scan(parts_dir: Path, pattern: str = PART_GLOB) -> tuple[dict[str, pa.Table], dict[str, str]]:
    """Every part in the directory (named like `pattern`: a shard's own, pipeline/shards.py), each verified
    whole: ({name: its INDEX columns, with the part's metadata} of good parts, {name: why} of bad ones). Only
    the index is kept (a part's outputs are read again when results.parquet is written), so a scan of a
    million rows stays small."""
    good: dict[str, pa.Table] = {}
    bad: dict[str, str] = {}
    for path in sorted(parts_dir.glob(pattern)) if parts_dir.is_dir() else []:
        try:
            t = read_part(path)
            good[path.name] = t.select(list(INDEX)).replace_schema_metadata(t.schema.metadata)
        except PartError as exc:
            bad[path.name] = str(exc)
    return good, bad


def quarantine(parts_dir: Path, name: str) -> Path:
    """Move a bad part aside (kept for inspection, never read again)."""
    dest = parts_dir / "corrupt"
    dest.mkdir(exist_ok=True)
    target = dest / name
    os.replace(parts_dir / name, target)
    fsync_dir(parts_dir)
    return target


def clean_temp(folder: Path, older_than_s: float = 3600.0) -> int:
    """Remove temporaries a crash left mid-write (never a complete part: those were renamed):
    at once when the process that wrote it (this host, its pid) is gone, else only old ones
    (a live worker on the same queue may be writing a young one right now)."""
    n = 0
    for tmp in folder.glob(".*.tmp") if folder.is_dir() else []:
        m = re.fullmatch(r"\..+~(.+)~(\d+)\.tmp", tmp.name)
        try:
            dead = m is not None and m.group(1) == _HOST and not procs.alive(int(m.group(2)))
            if dead or time.time() - tmp.stat().st_mtime >= older_than_s:
                tmp.unlink()
                n += 1
        except FileNotFoundError:
            pass
    return n
