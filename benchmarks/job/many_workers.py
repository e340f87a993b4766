"""Workers on one PostgreSQL queue (issue 26): job rows/s with 1, 2 and 4 workers, and the queue's own
cost (claims + acks per second at 4 workers that generate nothing), next to SQLite.

Starts its own PostgreSQL server (tests/pg_server.py: initdb into a temporary folder, Unix socket only,
fsync and synchronous commit on, as SQLite's synchronous=FULL).
Part 1, the tiny model: rounds in alternating order (1, 2, 4, 4, 2, 1 workers, and one SQLite worker),
each a fresh job of --rows rows: `action=enqueue` once, then N `action=work` processes at once. Reports
the wall time from the workers' start to the last exit (model loads included) and the steady rate
(rows over first claim to last acknowledgement, from the queue's attempts record).
Part 2, no model: 4 processes each loop claim(batch) -> mark running -> mark finished -> ack, as a
worker does per batch, over --queue-rows rows; rows/s and queue transactions/s, PostgreSQL and SQLite.
Part 3: one claim's latency with --scan-rows rows queued, none done vs 95% done (the claim query's scan).

    python -m benchmarks job.many_workers --rows 192 --max-tokens 96
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvbatch.pipeline.inputs import InputRow
from kvbatch.pipeline.queue import Queue, open_store
from tests.pg_server import PgServer, find_bindir

SMOKE = ["--parts", "23", "--queue-rows", "40", "--scan-rows", "400", "--spins", "2"]

# batches of 8 rows (+2 prefetched), so the rows spread over the workers instead of one claiming them all
SETTINGS = ["model=tiny", "job.chat_template=false", "output.progress=off", "worker.flush_rows=8",
            "engine.max_batch=8", "worker.prefetch=2"]


def _job_round(d: Path, url: str, n_workers: int, tag: str, args: list[str]) -> dict:
    out = d / f"out-{tag}"
    common = args + [f"job.name=bench-{tag}", f"output.dir={out}"] + ([f"queue.url='{url}'"] if url else [])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-m", "kvbatch", *common, "action=enqueue"], env=env, check=True,
                   capture_output=True, cwd=d)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "kvbatch", *common, "action=work", f"worker.host=w{i}"],
                              env=env, cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i in range(n_workers)]
    for p in procs:
        _, err = p.communicate(timeout=1200)
        assert p.returncode == 0, err.decode()[-2000:]
    wall = time.perf_counter() - t0
    cfg_hash = json.loads((out / "summary.json").read_text())["config_hash"]
    q = Queue(open_store(url, out, f"bench-{tag}/{cfg_hash}"))
    att = q.attempts()
    counts = q.counts()
    per_worker = {}
    for a in att:
        per_worker[a[2]] = per_worker.get(a[2], 0) + 1
    q.close()
    rows = counts["done"] + counts["error"]
    first, last = min(a[3] for a in att), max(a[4] for a in att if a[4])
    return {"workers": n_workers, "queue": "postgresql" if url else "sqlite", "rows": rows, "wall_s": wall,
            "rows_per_s_wall": rows / wall, "steady_s": last - first, "rows_per_s_steady": rows / (last - first),
            "rows_per_worker": sorted(per_worker.values())}


def _spin(url: str, folder: str, job: str, name: str, batch: int, out) -> None:
    q = Queue(open_store(url, Path(folder), job))
    rows = tx = 0
    t0 = time.perf_counter()
    while got := q.claim(name, batch, lease_s=60):
        keys = [c.key for c in got]
        q.mark_running(name, keys, True)
        q.mark_running(name, keys, False)
        q.ack(name, [(k, None) for k in keys], f"part-{name}-{tx:05d}.parquet")
        rows, tx = rows + len(keys), tx + 4
    out.put((rows, tx, time.perf_counter() - t0))
    q.close()


def _queue_round(d: Path, url: str, n_rows: int, tag: str, workers: int = 4, batch: int = 8) -> dict:
    folder, job = d / f"spin-{tag}", f"spin-{tag}"
    q = Queue(open_store(url, folder, job))
    t0 = time.perf_counter()
    q.enqueue([InputRow(i, f"k{i:07d}", {"prompt": f"p{i}"}) for i in range(n_rows)])
    enqueue_s = time.perf_counter() - t0
    q.close()
    res: mp.Queue = mp.Queue()
    t0 = time.perf_counter()
    ps = [mp.Process(target=_spin, args=(url, str(folder), job, f"s{i}", batch, res)) for i in range(workers)]
    for p in ps:
        p.start()
    got = [res.get(timeout=1200) for _ in ps]
    for p in ps:
        p.join()
    wall = time.perf_counter() - t0
    rows, tx = sum(g[0] for g in got), sum(g[1] for g in got)
    assert rows == n_rows, (rows, n_rows)
    return {"queue": "postgresql" if url else "sqlite", "workers": workers, "batch": batch, "rows": rows,
            "enqueue_rows_per_s": n_rows / enqueue_s, "wall_s": wall, "rows_per_s": rows / wall,
            "tx_per_s": tx / wall}


def _claim_latency(url: str, d: Path, n_rows: int) -> dict:
    out = {}
    for frac in (0.0, 0.95):
        job = f"scan-{int(frac * 100)}"
        q = Queue(open_store(url, d / job, job))
        q.enqueue([InputRow(i, f"k{i:07d}", {"prompt": f"p{i}"}) for i in range(n_rows)])
        done = int(n_rows * frac)
        q._x("UPDATE rows SET state='done', part='p' WHERE job=? AND pos < ?", (job, done))
        times = []
        for i in range(min(20, (n_rows - done) // 8)):
            t0 = time.perf_counter()
            got = q.claim(f"c{i}", 8, lease_s=60)
            times.append(time.perf_counter() - t0)
            assert len(got) == 8
        out[f"{int(frac * 100)}%_done_ms"] = 1000 * statistics.median(times)
        q.close()
    return out


def add_args(ap) -> None:
    ap.add_argument("--rows", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workers", default="1,2,4,4,2,1", help="part 1: workers of each PostgreSQL round")
    ap.add_argument("--queue-rows", type=int, default=4000)
    ap.add_argument("--spins", type=int, default=4, help="part 2: rounds (PostgreSQL and SQLite in turn)")
    ap.add_argument("--scan-rows", type=int, default=200_000)
    ap.add_argument("--parts", default="123", help="parts to run: 1 job rows/s, 2 queue cost, 3 claim latency")


def _jobs(d: Path, url: str, a) -> list[dict]:
    src = d / "rows.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i:04d}", "prompt": f"item{i} " * (2 + i % 6)}) + "\n"
                           for i in range(a.rows)))
    args = SETTINGS + [f"model.cache_dir={d / 'models'}", f"job.input={src}", f"job.max_tokens={a.max_tokens}"]
    _job_round(d, "", 1, "warm", args)  # builds the tiny model once
    rounds = []
    for i, n in enumerate(map(int, a.workers.split(","))):
        rounds.append(_job_round(d, url, n, f"pg{i}", args))
        print(json.dumps(rounds[-1]), flush=True)
    rounds.append(_job_round(d, "", 1, "sqlite", args))
    print(json.dumps(rounds[-1]), flush=True)
    return rounds


def _summary(rounds: list[dict]) -> dict:
    by: dict = {}
    for r in rounds:
        by.setdefault((r["queue"], r["workers"]), []).append(r)
    one = statistics.mean(r["rows_per_s_steady"] for r in by.get(("postgresql", 1), rounds))
    return {f"{q} x{n}": {"rows_per_s_steady": statistics.mean(r["rows_per_s_steady"] for r in rs),
                          "rows_per_s_wall": statistics.mean(r["rows_per_s_wall"] for r in rs),
                          "vs_1_pg_worker": statistics.mean(r["rows_per_s_steady"] for r in rs) / one}
            for (q, n), rs in sorted(by.items())}


def run(a) -> dict:
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("job.many_workers needs PostgreSQL's server binaries (make system-deps installs them)")
    server = PgServer(bindir, fsync=True).start()  # PostgreSQL's durable defaults
    out: dict = {}
    try:
        url = server.create_database("bench")
        with tempfile.TemporaryDirectory(prefix="kvbatch-many-") as tmp:
            d = Path(tmp)
            if "1" in a.parts:
                out["jobs"] = _jobs(d, url, a)
                out["summary"] = _summary(out["jobs"])
            if "2" in a.parts:
                out["queue"] = []
                for i in range(a.spins):
                    out["queue"].append(_queue_round(d, url if i % 2 == 0 else "", a.queue_rows, f"{i}"))
                    print(json.dumps(out["queue"][-1]), flush=True)
            if "3" in a.parts:
                out["claim_latency"] = _claim_latency(url, d, a.scan_rows)
                print(json.dumps({"claim_latency": out["claim_latency"], "rows": a.scan_rows}), flush=True)
    finally:
        server.stop()
    return out
