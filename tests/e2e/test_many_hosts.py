"""Workers on many hosts (issue 26): one PostgreSQL queue (a real server, tests/pg_server.py), one
shared output folder, real processes, the tiny model.

Four worker processes with four host identities (`worker.host`): on different hosts a PID means
nothing, so only leases tell who is alive. One worker is killed with `kill -9` mid-row, one is
frozen with SIGSTOP mid-row and never resumed: the other two take their rows over when the
leases expire, and results.parquet holds every row exactly once, with the tokens of a one-worker
SQLite run of the same job. Then Hydra's submitit launcher (local executor) starts two workers.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline.debug import ENV as CRASH_ENV
from kvbatch.pipeline.parts import read_part
from kvbatch.pipeline.queue import Queue, open_store

ROWS = [{"id": f"h{i:02d}", "prompt": f"host{i} " * (2 + i % 4), "max_tokens": (24, 48, 16, 64)[i % 4]}
        for i in range(20)]
KEYS = [r["id"] for r in ROWS]
SETTINGS = ["engine.max_batch=2", "engine.prefill_chunk=8", "worker.prefetch=1", "worker.flush_rows=2",
            "worker.flush_s=1000", "output.progress=off", "worker.lease_s=3"]


def _env(crash: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env["PYTHONWARNINGS"] = "ignore"
    if crash:
        env[CRASH_ENV] = crash
    return env


def kvbatch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbatch", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=600)


def start(args: list[str], log: Path, crash: str | None = None) -> subprocess.Popen:
    with open(log, "w") as err, open(log.with_suffix(".out"), "w") as so:
        return subprocess.Popen([sys.executable, "-m", "kvbatch", *args], cwd=log.parent, env=_env(crash),
                                stdout=so, stderr=err)


def wait_paused(p: subprocess.Popen, log: Path) -> None:
    limit = time.monotonic() + 300
    while "kvbatch-debug: paused at" not in (text := log.read_text()):
        assert p.poll() is None, f"the worker exited ({p.returncode}) before its crash point:\n{text}"
        assert time.monotonic() < limit, text
        time.sleep(0.05)


@pytest.fixture
def job(tmp_path, model_cache_dir):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", "job.chat_template=false",
            "job.name=hosts", *SETTINGS]


def test_four_hosts_one_killed_one_frozen_every_row_once_as_one_sqlite_worker(job, tmp_path, pg_url):
    ref = kvbatch(job + [f"output.dir={tmp_path / 'ref'}"], tmp_path)  # one worker, SQLite
    assert ref.returncode == 0, ref.stderr
    want = {r["row_key"]: r for r in pq.read_table(tmp_path / "ref" / "results.parquet").to_pylist()}

    out = tmp_path / "shared"
    args = job + [f"queue.url='{pg_url}'", f"output.dir={out}"]
    p = kvbatch(args + ["action=enqueue"], tmp_path)
    assert p.returncode == 0 and "20 new of 20 rows queued" in p.stdout, p.stderr
    job_id = p.stdout.split("(job ")[1].split(")")[0]
    q = Queue(open_store(pg_url, out, job_id))
    logs = {h: tmp_path / f"{h}.err" for h in ("h0", "h1", "h2", "h3")}
    work = args + ["action=work"]
    procs = {h: start(work + [f"worker.host={h}"], logs[h], crash="decode:6:pause") for h in ("h1", "h2")}
    frozen = procs["h2"]
    try:
        for h in ("h1", "h2"):  # both mid-row (6 decode steps in), holding rows
            wait_paused(procs[h], logs[h])
        procs.update({h: start(work + [f"worker.host={h}"], logs[h]) for h in ("h0", "h3")})
        limit = time.monotonic() + 300
        while q.counts()["done"] < 2:  # the other two are working too
            assert time.monotonic() < limit and procs["h0"].poll() is None, logs["h0"].read_text()
            time.sleep(0.1)
        held = {s["host"]: s["worker"] for s in q.sessions()}
        victims = {held["h1"], held["h2"]}
        assert all(n for w, n, _ in q.leases() if w in victims) and {w for w, _, _ in q.leases()} >= victims
        os.kill(procs["h1"].pid, signal.SIGKILL)
        os.kill(frozen.pid, signal.SIGSTOP)  # alive, never resumed: only its lease can free its rows
        for h in ("h0", "h3"):
            assert procs[h].wait(timeout=300) == 0, logs[h].read_text()
        assert procs["h1"].wait(timeout=30) == -signal.SIGKILL
        held = {s["host"]: s["worker"] for s in q.sessions()}  # all four registered by now
        assert len(held) == 4

        st = kvbatch(args + ["action=status", "worker.host=h0"], tmp_path)
        assert st.returncode == 0, st.stderr
        lines = st.stdout.splitlines()
        assert "remaining: none (every row has a result)" in lines, lines
        for h in ("h1", "h2"):  # another host's worker: judged by its heartbeat, not a PID
            assert any(ln.startswith(f"workers on {h}: {held[h]} silent (pid ") for ln in lines), lines
        fin = kvbatch(args + ["action=finalize"], tmp_path)
        assert fin.returncode == 0, fin.stderr
    finally:
        frozen.kill()
        frozen.wait(timeout=30)

    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["row_key"] for r in rows] == KEYS  # every row exactly once, in input order
    for r in rows:
        w = want[r["row_key"]]
        assert (r["output_token_ids"], r["finish_reason"], r["error_code"]) == \
            (w["output_token_ids"], w["finish_reason"], w["error_code"]), r["row_key"]
    assert {r["worker"] for r in rows} <= {held["h0"], held["h3"]} | victims
    for part in (out / "parts").glob("part-*.parquet"):
        read_part(part)  # every part whole
    # the killed and the frozen worker's claims ended by lease expiry, and others finished those rows
    taken = [a for a in q.attempts() if a[2] in victims]
    assert taken and all(a[5] in ("expired", "expired_not_running", "done", "error") for a in taken), taken
    expired = {a[0] for a in taken if a[5] in ("expired", "expired_not_running")}
    assert expired and all(r["worker"] not in victims for r in rows if r["row_key"] in expired)
    q.close()


def test_the_submitit_launcher_starts_two_workers_on_one_queue(job, tmp_path, pg_url):
    out = tmp_path / "shared"
    args = job + [f"queue.url='{pg_url}'", f"output.dir={out}", "job.name=submitit"]
    p = kvbatch(args + ["action=enqueue"], tmp_path)
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.split("(job ")[1].split(")")[0]
    p = kvbatch(["-m", *args, "action=work", "hydra/launcher=submitit_local", "worker.replica=range(2)",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "2 workers: 2 completed" in p.stderr, p.stderr
    q = Queue(open_store(pg_url, out, job_id))
    sessions = q.sessions()
    assert len(sessions) == 2 and all(s["stop"] == "finished" for s in sessions), sessions
    assert sorted("-r1-" in s["worker"] for s in sessions) == [False, True]  # replica 1 is named
    assert q.counts() == {"pending": 0, "leased": 0, "done": 20, "error": 0}
    assert [r["row_key"] for r in pq.read_table(out / "results.parquet").to_pylist()] == KEYS
    q.close()
