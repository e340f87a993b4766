"""Kill soak (issue 23): many random `kill -9` of real kvbatch workers, then a final run.

Longer than the CI kill loop (tests/e2e/test_never_stranded.py). Runs the tiny model on a
generated job: one uninterrupted reference run, then ROUNDS rounds of "start a worker, wait a
random while after the model loaded, SIGKILL it", then a final run, and compares results.parquet
with the reference row by row. Prints one JSON object: rows, kills, and rows lost, duplicated,
changed (tokens differ), stranded (pending/leased after the final run), charged (an error code
or attempt > 1), all expected 0.

    python -m benchmarks job.kill_soak --rows 96 --rounds 20 --seed 1
"""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

SMOKE = ["--rows", "3", "--rounds", "1", "--max-wait", "0.1"]
SETTINGS = ["model=tiny", "job.chat_template=false", "engine.max_batch=4", "engine.prefill_chunk=8",
            "worker.prefetch=2", "worker.flush_rows=2", "worker.flush_s=1000", "output.progress=off"]


def _cmd(args: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "kvbatch", *args, f"output.dir={out}"]


def add_args(ap) -> None:
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-wait", type=float, default=1.5, help="longest wait after model load before the kill")
    ap.add_argument("--checkpoint-tokens", type=int, default=0,
                    help="worker.checkpoint_every.tokens (0: the default interval): rows continue from checkpoints")


def run(a) -> dict:
    rng = random.Random(a.seed)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="kvbatch-soak-") as tmp:
        d = Path(tmp)
        src = d / "rows.jsonl"
        src.write_text("".join(json.dumps({"id": f"k{i:03d}", "prompt": f"item{i} " * (1 + i % 7),
                                           "max_tokens": [32, 128, 256, 384][i % 4]}) + "\n"
                               for i in range(a.rows)))
        args = SETTINGS + [f"model.cache_dir={d / 'models'}", f"job.input={src}"] + \
            ([f"worker.checkpoint_every.tokens={a.checkpoint_tokens}"] if a.checkpoint_tokens else [])
        t0 = time.perf_counter()
        subprocess.run(_cmd(args, d / "ref"), env=env, check=True, capture_output=True)
        ref_s = time.perf_counter() - t0
        ref = {r["row_key"]: r["output_token_ids"] for r in pq.read_table(d / "ref" / "results.parquet").to_pylist()}
        out, killed, finished_early = d / "out", 0, 0
        t0 = time.perf_counter()
        for i in range(a.rounds):
            log = d / f"round{i}.err"
            with open(log, "w") as err:
                p = subprocess.Popen(_cmd(args, out), env=env, stdout=subprocess.DEVNULL, stderr=err)
            while "memory plan:" not in log.read_text() and p.poll() is None:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, a.max_wait))
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                killed += 1
            else:
                finished_early += 1
            p.wait()
        final = subprocess.run(_cmd(args, out), env=env, capture_output=True, text=True)
        soak_s = time.perf_counter() - t0
        rows = pq.read_table(out / "results.parquet").to_pylist()
        count = Counter(r["row_key"] for r in rows)
        db = sqlite3.connect(out / "queue.sqlite")
        stranded = db.execute("SELECT COUNT(*) FROM rows WHERE state IN ('pending','leased')").fetchone()[0]
        crashes = db.execute("SELECT SUM(crashes), MAX(crashes) FROM rows").fetchone()
        stops = Counter(s for (s,) in db.execute("SELECT stop FROM workers"))
        result = {
            "rows": a.rows, "rounds": a.rounds, "seed": a.seed, "kills": killed,
            "rounds_finished_first": finished_early,
            "final_exit": final.returncode,
            "lost": sum(1 for k in ref if k not in count), "duplicated": sum(1 for n in count.values() if n > 1),
            "changed": sum(1 for r in rows if r["row_key"] in ref and r["output_token_ids"] != ref[r["row_key"]]),
            "stranded": stranded,
            "charged": sum(1 for r in rows if r["error_code"] is not None or (r["attempt"] or 0) > 1),
            "crashes_total": crashes[0], "crashes_max_per_row": crashes[1], "worker_sessions": dict(stops),
            "resumed_rows": sum(1 for r in rows if r.get("resumed_tokens")),
            "resumed_tokens": sum(r.get("resumed_tokens") or 0 for r in rows),
            "reference_run_s": round(ref_s, 1), "soak_s": round(soak_s, 1)}
    print(json.dumps(result), flush=True)
    result["failed"] = bool(final.returncode or result["lost"] or result["duplicated"] or result["changed"]
                            or result["stranded"])
    return result
