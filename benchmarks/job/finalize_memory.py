"""Finalize at scale: peak memory and time of `finalize` over N one-token rows, and of a finished job's rerun.

Synthetic, no model: a SQLite queue of N rows, every row finished in a part of --part-rows rows (the parts a
worker writes, each acknowledged in the queue), then `finalize` in a fresh process, twice (the second is a
finished job's rerun: reconcile + results.parquet again). Each finalize's peak RSS is the child process's
own (ru_maxrss), so the setup's memory does not count. Prints one JSON object.

    python -m benchmarks job.finalize_memory --rows 1000000 --part-rows 64
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOKE = ["--rows", "200", "--part-rows", "16"]

CHILD = """
import json, resource, sys, time
from pathlib import Path
import kvbatch.engine
from kvbatch.pipeline.finalize import finalize
from kvbatch.pipeline.queue import Queue
out = Path(sys.argv[1])
q = Queue(out / "queue.sqlite")
t0 = time.perf_counter()
fin = finalize(out, q, {"kvbatch.config": "{}"})
wall = time.perf_counter() - t0
print(json.dumps({"rows": fin.rows, "wall_s": wall, "adopted": fin.adopted, "requeued": len(fin.requeued),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def add_args(ap) -> None:
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--part-rows", type=int, default=64, help="rows per part (a worker writes ~worker.flush_rows)")


def _setup(out: Path, n: int, per_part: int) -> None:
    """N queue rows, each finished (done) in a part of per_part one-token rows."""
    import pyarrow.parquet as pq

    from kvbatch.pipeline.inputs import InputRow
    from kvbatch.pipeline.parts import keys_digest, part_name
    from kvbatch.pipeline.queue import Queue
    from kvbatch.pipeline.results import ResultRecord, to_table

    q = Queue(out / "queue.sqlite")
    q.db.execute("PRAGMA synchronous=OFF")  # the setup's own writes need no durability
    (out / "parts").mkdir()
    q.enqueue(InputRow(i, f"row-{i:07d}", {"prompt": "p"}) for i in range(n))
    acks = []
    for seq, start in enumerate(range(0, n, per_part)):
        name = part_name("bench-worker", seq)
        recs = [ResultRecord(row_key=f"row-{i:07d}", row_index=i, prompt="p", output="a", output_token_ids=[97],
                             output_tokens=1, finish_reason="length", worker="bench-worker", attempt=1)
                for i in range(start, min(start + per_part, n))]
        keys = [r.row_key for r in recs]  # what parts.write_part writes, without its fsync (setup speed)
        meta = {"kvbatch.part.rows": str(len(recs)), "kvbatch.part.keys_sha256": keys_digest(keys)}
        pq.write_table(to_table(recs, meta), out / "parts" / name, compression="zstd", write_page_checksum=True)
        acks.extend((name, r.row_key) for r in recs)
    # every row acknowledged from its part (one transaction: the synthetic setup, not what is measured)
    with q.s.tx():
        q.s.executemany("UPDATE rows SET state='done', part=?, worker='bench-worker', attempts=1 WHERE key=?", acks)
    q.close()


def _finalize(out: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(a) -> dict:
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="kvbatch-finalize-") as tmp:
        out = Path(tmp)
        t0 = time.perf_counter()
        _setup(out, a.rows, a.part_rows)
        setup_s = time.perf_counter() - t0
        first = _finalize(out)
        rerun = _finalize(out)
        meta = pq.ParquetFile(out / "results.parquet").metadata
        result = {"rows": a.rows, "part_rows": a.part_rows, "parts": -(-a.rows // a.part_rows),
                  "setup_s": round(setup_s, 1), "finalize": first, "rerun": rerun,
                  "results_rows": meta.num_rows, "results_row_groups": meta.num_row_groups,
                  "peak_rss_gib": round(max(first["peak_rss_bytes"], rerun["peak_rss_bytes"]) / 2**30, 3)}
    print(json.dumps(result, indent=1))
    result["failed"] = result["results_rows"] != a.rows
    return result
