"""benchmarks/local_workers.py: a job run as N worker processes on one queue, as a drop-in for the kvbatch
command in a benchmark side. Both workers run on the job's queue, every row comes back once, and the side reads
the results as it reads the command's. (Which worker generates which rows depends on timing, so it is not
asserted: a fast worker may take them all before the other has loaded its model.)"""
from __future__ import annotations

import json
import sqlite3
import sys

from benchmarks.job.job_vs_mlx_lm import run_kvbatch


def test_the_job_runs_as_two_workers_and_reads_like_the_command(tmp_path, model_cache_dir):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"Count the stones of river {i}."}) + "\n" for i in range(12)))
    model = {"name": "tiny", "cache_dir": str(model_cache_dir)}
    extra = ["engine.max_batch=4", "worker.prefetch=0"]
    cmd = [sys.executable, "-m", "benchmarks.local_workers", "--workers", "2", "--budget", "2GiB"]
    got = run_kvbatch(cmd, inp, tmp_path / "two", "tiny", model, 24, extra)
    one = run_kvbatch([sys.executable, "-m", "kvbatch"], inp, tmp_path / "one", "tiny", model, 24, extra)
    assert got["rows"] == 12 and got["ok"] == one["ok"] > 0
    assert got["outputs"] == one["outputs"]  # greedy: the same tokens whichever process ran a row
    with sqlite3.connect(tmp_path / "two" / "queue.sqlite") as db:
        sessions = db.execute("SELECT rows FROM workers").fetchall()
    assert len(sessions) == 2 and sum(n for (n,) in sessions) == 12  # two worker sessions, each row generated once
