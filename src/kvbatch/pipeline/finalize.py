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

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from kvbatch.pipeline import job_identity, passthrough, samples
from kvbatch.pipeline.parts import clean_temp, quarantine, scan, write_atomic
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
    table: pa.Table | None = None
    chosen: list[tuple[int, str, int]] = field(default_factory=list)  # (input pos, part, row in part)
    good: dict[str, pa.Table] = field(default_factory=dict)


def reconcile(out_dir: Path, q: Queue) -> Finalized:
    """Match the queue against the parts on disk: quarantine bad parts, adopt rows that are
    durable but unacknowledged, re-queue finished rows whose part is gone. Workers call this
    before claiming, so a row whose part survived a crash is never generated again."""
    with q.exclusive():
        return _reconcile(out_dir, q)


def _reconcile(out_dir: Path, q: Queue) -> Finalized:
    parts_dir = out_dir / "parts"
    clean_temp(parts_dir)
    # The queue first, then the parts: a worker renames its part before it acknowledges, so a
    # row seen finished here has its part on disk already. (The other order takes a part that
    # lands between the two reads for lost, and a live worker's row would be generated again.)
    manifest = q.manifest()
    good, bad = scan(parts_dir)
    for name in bad:
        quarantine(parts_dir, name)
    mine = q.get_meta(job_identity.META)  # only this job's parts: another job's rows never come back as its own
    foreign = {name: str(job_identity.of_part(t.schema.metadata)) for name, t in good.items()
               if not job_identity.owns(mine, t.schema.metadata)}
    for name in foreign:
        del good[name]
    stale_parts, stale_workers = q.superseded()  # results of older content or settings: never taken
    index = {name: _fresh(name, t, stale_parts, stale_workers) for name, t in good.items()}
    where: dict[str, tuple[str, int]] = {}  # key -> (part, row); the first part (by name) wins
    for name, keys in index.items():
        for key, i in keys.items():
            where.setdefault(key, (name, i))
    chosen: list[tuple[int, str, int]] = []  # (manifest pos, part, row)
    adopt: dict[str, list] = {}
    lost: list[tuple[str, str]] = []  # (key, the part the queue says holds it)
    done = Finalized(out_dir / RESULTS, bad_parts=bad, foreign=foreign, chosen=chosen, good=good)
    for pos, key, state, part, _attempts in manifest:
        if state in ("done", "error"):
            assert part is not None  # a finished row names the part that holds it (Queue.ack, adopt)
            if key in index.get(part, ()):
                chosen.append((pos, part, index[part][key]))
            elif key in where:
                chosen.append((pos, *where[key]))
            else:
                done.requeued.append(key)
                lost.append((key, part))
        elif key in where:
            chosen.append((pos, *where[key]))
            name, i = where[key]
            t = good[name]
            adopt.setdefault(name, []).append((key, t.column("error_code")[i].as_py(), t.column("worker")[i].as_py()))
        else:
            done.remaining += 1
    for name, items in adopt.items():
        q.adopt(items, name)
        done.adopted += len(items)
    if done.requeued:
        q.requeue(lost, "lost_part")
    return done


def _fresh(name: str, table: pa.Table, stale_parts: set, stale_workers: set) -> dict[str, int]:
    """{row key: row} of a part, without the rows that were superseded (see Queue.regenerate)."""
    keys, workers = table.column("row_key").to_pylist(), table.column("worker").to_pylist()
    return {k: i for i, (k, w) in enumerate(zip(keys, workers))
            if (k, name) not in stale_parts and (k, w) not in stale_workers}


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
    """results.parquet (written atomically) from the reconciled parts."""
    with q.exclusive():
        clean_temp(out_dir)
        done = _reconcile(out_dir, q)
        slots = samples.slots_of(q.get_meta(samples.META))
        table = passthrough.attach(_assemble(done.good, done.chosen, slots), out_dir)
        table = table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})
        write_atomic(table, done.path)
    done.rows, done.table = table.num_rows, table
    return done


def _assemble(good: dict[str, pa.Table], chosen: list[tuple[int, str, int]], slots: int = 1) -> pa.Table:
    """Take the chosen rows from their parts, set row_index to the input position (queue position //
    slots: pipeline/samples.py), sort by it and the sample index."""
    if not chosen:
        return to_table([])
    by_part: dict[str, list[tuple[int, int]]] = {}
    for pos, name, i in chosen:
        by_part.setdefault(name, []).append((pos, i))
    pieces = []
    for name, rows in by_part.items():
        t = good[name].replace_schema_metadata(None).take(pa.array([i for _, i in rows], pa.int64()))
        pieces.append(t.set_column(t.column_names.index("row_index"), "row_index",
                                   pa.array([p // slots for p, _ in rows], pa.int64())))
    table = pa.concat_tables(pieces).cast(SCHEMA)
    # pyarrow.compute makes its functions at import (from globals()): no stub names them
    return table.take(pc.sort_indices(table, sort_keys=[("row_index", "ascending"), ("sample_index", "ascending")]))  # pyright: ignore[reportAttributeAccessIssue]
