"""Twenty random `kill -9` with checkpoints on (issue 40): nothing is lost, duplicated or changed, with one
worker and with two on one queue, on SQLite and on PostgreSQL.

Each store gets 10 kills of real worker processes (tests/e2e/test_durable.py's helpers). First 2 of one
worker: at a random crash point (a prefill chunk, a decode step, a part's write or acknowledgement:
paused there, killed from outside), and as it runs, wherever it is, once the queue holds a few more
checkpoints than before. Then 8 with two workers on the same queue, four pairs: each worker pauses at a
random decode step of its own and is killed there while the other works on. A run in this process ends the job.
Kills follow the queue's and the workers' progress (seeded RNG), never a timer; checkpoints every 16
tokens (a token count: the same on any machine). Results are compared with an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline import actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.parts import read_part
from kvbatch.pipeline.queue import Queue
from tests.e2e.test_durable import check_files, kill_9_at, start
from tests.e2e.test_many_hosts import wait_paused

ROWS = [{"id": f"c{i:02d}", "prompt": f"keep{i} " * (1 + i % 6), "max_tokens": (64, 160, 112, 224)[i % 4]}
        for i in range(16)]
KEYS = [r["id"] for r in ROWS]
EVERY = 16
SETTINGS = ["job.chat_template=false", "job.ignore_eos=true", "engine.max_batch=4", "engine.prefill_chunk=8",
            "worker.prefetch=1", "worker.flush_rows=2", "worker.flush_s=1000", "output.progress=off",
            f"worker.checkpoint_every.tokens={EVERY}", "worker.checkpoint_every.seconds=0", "worker.lease_s=3",
            # kills from outside are not the rows' fault: no row runs alone or is given up over 10 of them
            "worker.isolate_after=50", "worker.max_crashes=60"]
CRASH_POINTS = [("decode", 4, 32), ("prefill", 1, 3), ("part_tmp", 1, 2), ("after_part_write", 1, 2),
                ("after_ack", 1, 1)]
LIMIT_S = 300


@pytest.fixture(scope="module")
def job(tmp_path_factory, model_cache_dir):
    """(args, reference results by key): the job, and one uninterrupted run of it (in this process)."""
    d = tmp_path_factory.mktemp("kill-ck")
    src = d / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", *SETTINGS]
    path = actions.execute(compose_config(args + [f"output.dir={d / 'ref'}"]))
    ref = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    assert list(ref) == KEYS and all(r["output_tokens"] == m["max_tokens"] for r, m in zip(ref.values(), ROWS))
    return args, ref


def _saves(q: Queue) -> int:
    """Row checkpoints saved so far in the queue (every worker, every run)."""
    return int(q.s.execute("SELECT COALESCE(SUM(saves), 0) FROM checkpoints WHERE job=?", (q.job,)).fetchone()[0])


def _registered(q: Queue, p: subprocess.Popen) -> bool:
    return any(s["pid"] == p.pid and s["ended_at"] is None for s in q.sessions())


def _wait(what, p: subprocess.Popen, log: Path) -> None:
    """Poll until `what()` holds (a worker that exits meanwhile fails the test: the job was too short)."""
    limit = time.monotonic() + LIMIT_S
    while not what():
        assert p.poll() is None, f"the worker exited ({p.returncode}) before its kill:\n{log.read_text()}"
        assert time.monotonic() < limit, log.read_text()
        time.sleep(0.02)


def _kill(p: subprocess.Popen) -> None:
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL


def one_worker(out: Path, args: list[str], q: Queue, rng: random.Random, rounds: int, logs: Path) -> None:
    """`rounds` kills of one worker: at a random crash point (even rounds), or as it runs once the queue's
    checkpoints grew by 2-8 (odd rounds)."""
    for i in range(rounds):
        log = logs / f"one{i}.err"
        if i % 2 == 0:
            point, lo, hi = rng.choice(CRASH_POINTS)
            kill_9_at(out, args, f"{point}:{rng.randint(lo, hi)}:pause", log)
        else:
            target = _saves(q) + rng.randint(2, 8)
            p = start(out, args, log)
            _wait(lambda: _saves(q) >= target and _registered(q, p), p, log)
            _kill(p)


def two_workers(out: Path, args: list[str], rng: random.Random, rounds: int, logs: Path) -> None:
    """`rounds` pairs of workers on the queue: each worker pauses at a random decode step (4-24) and is killed
    there while the other works on; then the next pair starts."""
    for r in range(rounds):
        workers = [(start(out, args, log, f"decode:{rng.randint(4, 24)}:pause"), log)
                   for log in (logs / f"pair{r}-{i}.err" for i in range(2))]
        try:
            for p, log in workers:
                wait_paused(p, log)
                _kill(p)
        finally:
            for p, _ in workers:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=60)


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_twenty_kill_9_lose_duplicate_and_change_nothing(job, tmp_path, request, store):
    args, ref = job
    out = tmp_path / "out"
    if store == "postgresql":
        args = args + [f"queue.url='{request.getfixturevalue('pg_url')}'", "job.name=kill_ck"]
    args = args + ["action=work"]
    cfg = compose_config(args + [f"output.dir={out}"])
    q, _, _ = actions.enqueue(actions.job_for(cfg))
    rng = random.Random(40)
    one_worker(out, args, q, rng, 2, tmp_path)
    two_workers(out, args, rng, 4, tmp_path)

    assert q.counts()["done"] < len(KEYS)  # every kill came before the job's end
    path = actions.execute(compose_config(args[:-1] + ["action=run", f"output.dir={out}"]))  # the rest, here
    rows = pq.read_table(path).to_pylist()
    assert [r["row_key"] for r in rows] == KEYS  # nothing lost, nothing duplicated, input order
    for r in rows:  # nothing changed: the tokens of the uninterrupted run, no row charged an attempt
        want = ref[r["row_key"]]
        assert (r["output_token_ids"], r["finish_reason"], r["error_code"], r["attempt"]) == \
            (want["output_token_ids"], want["finish_reason"], None, 1), r["row_key"]
    assert sum(r["resumed_tokens"] > 0 for r in rows) >= 2  # rows continued from their checkpoints
    assert all(r["resumed_tokens"] % EVERY == 0 for r in rows)  # ... at checkpoint boundaries
    assert q.counts() == {"pending": 0, "leased": 0, "done": len(KEYS), "error": 0}  # nothing stranded
    assert sorted(a[0] for a in q.attempts() if a[5] == "done") == KEYS  # one acknowledged run per row
    stops = [s["stop"] for s in q.sessions()]
    assert stops.count("died") == 10 and stops.count("finished") == 1 and len(stops) == 11, stops
    if store == "sqlite":
        assert check_files(out) == []
    else:
        for part in (out / "parts").glob("part-*.parquet"):
            read_part(part)
    q.close()
