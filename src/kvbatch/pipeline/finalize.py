"""Finalize: results.parquet from the durable parts, each input row (each of its samples) exactly once,
in input order.

The queue says which part holds each finished row; a row found in a part but not
acknowledged (its worker died between the rename and the ack) is adopted, not run
again; a finished row whose part is missing or corrupt goes back to the queue, so
it is generated again and never silently dropped. Duplicates (a row generated
twice) are resolved to the part the queue acknowledged. Both run under the queue's lock (the
output folder's lock file with SQLite, an advisory lock in the database with PostgreSQL, which
holds across hosts where file locks on a network file system may not), so several workers on
one queue reconcile one at a time.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvbatch.pipeline import job_identity, passthrough, samples
from kvbatch.pipeline.parts import PART_GLOB, clean_temp, fsync_dir, quarantine, read_table, scan, temp_path
from kvbatch.pipeline.results import SCHEMA, to_table
from kvbatch.pipeline.queue import Queue

RESULTS = "results.parquet"


@dataclass
class Finalized:
    """What reconcile and finalize found and did: rows written and remaining, parts adopted, rows requeued, corrupt
    parts."""

    path: Path
    rows: int = 0  # rows written
    remaining: int = 0  # manifest rows with no result yet (pending / leased)
    requeued: list[str] = field(default_factory=list)  # finished rows whose part was lost
    adopted: int = 0  # rows found in a part but never acknowledged
    bad_parts: dict[str, str] = field(default_factory=dict)
    foreign: dict[str, str] = field(default_factory=dict)  # parts of another job in the folder: {name: its job}
    # the rows results.parquet takes, in queue order: queue positions and locations (part id << 32 | row)
    positions: array = field(default_factory=lambda: array("q"))
    locations: array = field(default_factory=lambda: array("q"))
    parts: list[str] = field(default_factory=list)  # part id -> part name
    unchanged: bool = False  # results.parquet was already written from this very state: nothing was done

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """results.parquet as written (only `columns`: the summary needs a few)."""
        return pq.read_table(self.path, columns=columns)


def reconcile(out_dir: Path, q: Queue, pattern: str = PART_GLOB) -> Finalized:
    """Match the queue against the parts on disk: quarantine bad parts, adopt rows that are
    durable but unacknowledged, re-queue finished rows whose part is gone. Workers call this
    before claiming, so a row whose part survived a crash is never generated again. Nothing to do
    when results.parquet was written from exactly this queue and these parts (a finished job's rerun).
    `pattern`: the parts to look at (a shard's own: pipeline/shards.py)."""
    with q.exclusive():
        return _unchanged(out_dir, q, _state(out_dir, q, pattern)) or _reconcile(out_dir, q, pattern)


STATE_KEY = "kvbatch.state"  # results.parquet's metadata: the state it was written from (_state)


def _state(out_dir: Path, q: Queue, pattern: str = PART_GLOB) -> str:
    """A digest of everything results.parquet's rows are made from: the queue's rows, the parts on disk
    (name, size, modification time) and passthrough.parquet."""
    parts_dir = out_dir / "parts"
    listing = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(parts_dir)
                     if fnmatch.fnmatch(e.name, pattern)) if parts_dir.is_dir() else []
    carried = out_dir / passthrough.FILE
    extra = [carried.stat().st_size, carried.stat().st_mtime_ns] if carried.exists() else None
    blob = json.dumps([q.fingerprint(), listing, extra, q.get_meta(samples.META)], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _unchanged(out_dir: Path, q: Queue, state: str, metadata: dict[str, str] | None = None) -> Finalized | None:
    """results.parquet's Finalized when it was written from `state` (with these metadata), else None."""
    path = out_dir / RESULTS
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:  # noqa: BLE001 - missing or unreadable: written again
        return None
    kv = meta.metadata or {}
    if kv.get(STATE_KEY.encode()) != state.encode() or (metadata is not None and any(
            kv.get(k.encode()) != v.encode() for k, v in metadata.items())):
        return None
    counts = q.counts()
    return Finalized(path, rows=meta.num_rows, remaining=counts["pending"] + counts["leased"], unchanged=True)


_STATES = {"pending": 0, "leased": 1, "done": 2, "error": 3}


def _reconcile(out_dir: Path, q: Queue, pattern: str = PART_GLOB) -> Finalized:
    parts_dir = out_dir / "parts"
    clean_temp(parts_dir)
    # The queue first, then the parts: a worker renames its part before it acknowledges, so a
    # row seen finished here has its part on disk already. (The other order takes a part that
    # lands between the two reads for lost, and a live worker's row would be generated again.)
    # Held compactly (a million rows are a few tens of MB): keys, positions, states, acknowledged part ids.
    names: dict[str, int] = {}  # part name -> id (a location is id << 32 | row in the part)
    keys: list[str] = []
    poss, acked, states = array("q"), array("q"), bytearray()
    for pos, key, state, part, _attempts in q.manifest_rows():
        keys.append(key)
        poss.append(pos)
        states.append(_STATES[state])
        acked.append(names.setdefault(part, len(names)) if part else -1)
    good, bad = scan(parts_dir, pattern)
    for name in bad:
        quarantine(parts_dir, name)
    mine = q.get_meta(job_identity.META)  # only this job's parts: another job's rows never come back as its own
    foreign = {name: str(job_identity.of_part(t.schema.metadata)) for name, t in good.items()
               if not job_identity.owns(mine, t.schema.metadata)}
    for name in foreign:
        del good[name]
    stale_parts, stale_workers = q.superseded()  # results of older content or settings: never taken
    where: dict[str, int] = {}  # key -> location of its first fresh copy (parts by name: the first wins)
    more: dict[str, list[int]] = {}  # key -> locations of its other fresh copies (a row generated twice)
    for name, t in good.items():  # scan's order: by name
        pid = names.setdefault(name, len(names))
        part_keys = t.column("row_key").to_pylist()
        for i in _fresh(name, t, stale_parts, stale_workers):
            k, loc = part_keys[i], pid << 32 | i
            if k in where:
                more.setdefault(k, []).append(loc)
            else:
                where[k] = loc
    by_id = list(names)
    adopt: dict[str, list] = {}
    lost: list[tuple[str, str]] = []  # (key, the part the queue says holds it)
    done = Finalized(out_dir / RESULTS, bad_parts=bad, foreign=foreign, parts=by_id)
    for j, key in enumerate(keys):
        loc = where.get(key)
        if states[j] >= _STATES["done"]:
            assert acked[j] >= 0  # a finished row names the part that holds it (Queue.ack, adopt)
            if loc is not None and loc >> 32 != acked[j]:  # the acknowledged part's copy, where it has one
                loc = next((x for x in more.get(key, ()) if x >> 32 == acked[j]), loc)
            if loc is None:
                done.requeued.append(key)
                lost.append((key, by_id[acked[j]]))
                continue
        elif loc is not None:
            name, i = by_id[loc >> 32], loc & 0xFFFFFFFF
            t = good[name]
            adopt.setdefault(name, []).append((key, t.column("error_code")[i].as_py(), t.column("worker")[i].as_py()))
        else:
            done.remaining += 1
            continue
        done.positions.append(poss[j])
        done.locations.append(loc)
    for name, items in adopt.items():
        q.adopt(items, name)
        done.adopted += len(items)
    if done.requeued:
        q.requeue(lost, "lost_part")
    return done


def _fresh(name: str, table: pa.Table, stale_parts: set, stale_workers: set) -> list[int]:
    """The rows of a part that were not superseded (see Queue.regenerate)."""
    if not stale_parts and not stale_workers:
        return list(range(table.num_rows))
    keys, workers = table.column("row_key").to_pylist(), table.column("worker").to_pylist()
    return [i for i, (k, w) in enumerate(zip(keys, workers))
            if (k, name) not in stale_parts and (k, w) not in stale_workers]


def regenerate(out_dir: Path, q: Queue, keys: list[str], reason: str) -> None:
    """Generate `keys` again from scratch: every result they have in a part is superseded (under the
    folder's lock, so no reconcile sees the row half-way)."""
    if not keys:
        return
    wanted = set(keys)
    with q.exclusive():
        good, _ = scan(out_dir / "parts")
        mine = q.get_meta(job_identity.META)
        good = {name: t for name, t in good.items() if job_identity.owns(mine, t.schema.metadata)}
        found = [(k, name) for name, t in good.items() for k in t.column("row_key").to_pylist() if k in wanted]
        q.regenerate(keys, found, reason)


def finalize(out_dir: Path, q: Queue, metadata: dict[str, str]) -> Finalized:
    """results.parquet (written atomically) from the reconciled parts, streamed: CHUNK rows at a time are
    taken from their parts and written, so memory stays bounded however many rows the job has."""
    with q.exclusive():
        state = _state(out_dir, q)
        same = _unchanged(out_dir, q, state, metadata)
        if same is not None:  # a finished job's rerun: nothing changed since it was written
            return same
        clean_temp(out_dir)
        done = _reconcile(out_dir, q)
        slots = samples.slots_of(q.get_meta(samples.META))
        # The file is stamped with the state read before its rows were: other workers acknowledge rows
        # without this lock, and a state read after the rows would name an acknowledgement the file
        # lacks, so the next finalize would skip that row. An older stamp only makes it write again.
        metadata = {**metadata, STATE_KEY: state}
        done.rows = _write(done, out_dir / "parts", slots, passthrough.load(out_dir), metadata)
    return done


CHUNK = 8192  # rows of results.parquet assembled at once (a row group each)


def _write(done: Finalized, parts_dir: Path, slots: int, carried: "passthrough.Carried | None",
           metadata: dict[str, str]) -> int:
    """Write the chosen rows (already in queue order: input position, then sample) to done.path, durably:
    a temporary file, fsynced, renamed. Returns the rows written."""
    meta = {k.encode(): v.encode() for k, v in metadata.items()}
    cache: dict[str, pa.Table] = {}
    n = len(done.positions)
    tmp = temp_path(done.path)
    writer = None
    try:
        with open(tmp, "wb") as fh:
            for start in range(0, max(n, 1), CHUNK):
                table = _assemble(parts_dir, done, start, min(start + CHUNK, n), slots, cache)
                if carried is not None:
                    table = carried.attach(table)
                table = table.replace_schema_metadata(meta)
                if writer is None:
                    writer = pq.ParquetWriter(fh, table.schema, compression="zstd", write_page_checksum=True)
                writer.write_table(table)
            assert writer is not None  # one chunk at least (an empty one for no rows)
            writer.close()
            writer = None
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, done.path)
    fsync_dir(done.path.parent)
    return n


def _assemble(parts_dir: Path, done: Finalized, start: int, end: int, slots: int,
              cache: dict[str, pa.Table]) -> pa.Table:
    """Rows start..end of the chosen ones, taken from their parts in that order, with row_index set to the
    input position (queue position // slots: pipeline/samples.py). `cache` keeps the parts of the last
    chunk: a part's rows are near each other in the queue's order, so each part is read about once."""
    if start >= end:
        return to_table([])
    by_part: dict[str, list[int]] = {}
    for j in range(start, end):
        by_part.setdefault(done.parts[done.locations[j] >> 32], []).append(j)
    for name in [n for n in cache if n not in by_part]:
        del cache[name]
    pieces, order = [], []
    for name, js in by_part.items():
        if name not in cache:
            cache[name] = read_table(parts_dir / name).replace_schema_metadata(None)
        pieces.append(cache[name].take(pa.array([done.locations[j] & 0xFFFFFFFF for j in js], pa.int64())))
        order.extend(js)
    table = pa.concat_tables(pieces).cast(SCHEMA)
    back = [0] * len(order)
    for k, j in enumerate(order):
        back[j - start] = k
    table = table.take(pa.array(back, pa.int64()))
    return table.set_column(table.column_names.index("row_index"), "row_index",
                            pa.array([done.positions[j] // slots for j in range(start, end)], pa.int64()))
