"""worker.processes=N: the command runs N worker processes on the job's one queue, each with 1/N of the memory
budget, and shows them as one run. Every row is generated once, with the tokens one process gives; a worker's stop
(the deadline, a device failure) is the run's, and the same command continues the job.

Which worker generates which rows depends on timing (a fast worker may take them all before the other has loaded
its model), so it is never asserted: the queue's record of two worker sessions and each row's one claim is."""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import replace

import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import Config, ConfigError, WorkerConfig
from kvbatch.pipeline import procs
from tests.e2e.test_durable import kvbatch, start
from kvbatch.pipeline.processes import Relay, Workers, worker_config
from kvbatch.pipeline.progress import Progress
from kvbatch.pipeline.queue import Queue
from kvbatch.engine.config import MemoryConfig
from kvbatch.engine.sizes import parse_size

ROWS = 12


@pytest.fixture(scope="module")
def job(tmp_path_factory, model_cache_dir):
    tmp_path = tmp_path_factory.mktemp("processes")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i:02d}", "prompt": f"Count the stones of river {i}."}) + "\n"
                           for i in range(ROWS)))
    args = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={inp}", "job.max_tokens=24",
            "engine.max_batch=4", "worker.prefetch=0", "output.progress=off"]
    ref = kvbatch(tmp_path / "one", args)
    assert ref.returncode == 0, ref.stderr
    budget = json.loads((tmp_path / "one" / "summary.json").read_text())["engine"]["budget_bytes"]
    return args, _tokens(tmp_path / "one"), budget


def _tokens(out) -> dict:
    rows = pq.read_table(out / "results.parquet").to_pylist()
    return {r["row_key"]: (r["error_code"], r["output_token_ids"]) for r in rows}


def test_two_processes_generate_every_row_once_with_one_process_tokens(job, tmp_path):
    args, ref, one = job
    out = tmp_path / "two"
    p = kvbatch(out, args + ["worker.processes=2"])
    assert p.returncode == 0, p.stderr
    assert _tokens(out) == ref and all(code is None for code, _ in ref.values())
    q = Queue(out / "queue.sqlite")
    sessions = q.sessions()
    assert len(sessions) == 2 and sum(s["rows"] for s in sessions) == ROWS  # two workers, each row once
    assert sorted(r[0] for r in q.attempts()) == sorted(ref)
    q.close()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["this_run"]["rows"] == ROWS and summary["this_run"]["generated_tokens"] == summary["output_tokens"]
    # each worker planned with half the auto budget (what the machine can give moves a little between runs)
    halves = [s["summary"]["budget_bytes"] / one for s in sessions]
    assert all(0.35 < h < 0.65 for h in halves), halves
    # summary.json's engine is both workers' together: their budgets and tokens add up, not the last one's alone
    eng = summary["engine"]
    assert eng["budget_bytes"] == sum(s["summary"]["budget_bytes"] for s in sessions)
    assert eng["generated_tokens"] == summary["output_tokens"] == sum(s["tokens"] for s in sessions)
    assert eng["decode_s"] == max(s["summary"]["decode_s"] for s in sessions)
    # the run's resident memory counts the workers' (each holds a model), not only this process's
    assert summary["peak_rss_bytes"] > 2 * 100 * 2**20, summary["peak_rss_bytes"]


def test_a_workers_deadline_is_the_runs_and_the_same_command_finishes_the_job(job, tmp_path):
    args, ref, _ = job
    out = tmp_path / "two"
    p = kvbatch(out, args + ["worker.processes=2", "debug.deadline_after_rows=2"])
    assert p.returncode == 0, p.stderr
    m = re.search(r"deadline reached; (\d+) rows remain queued", p.stderr)
    assert m and int(m.group(1)) > 0, p.stderr
    q = Queue(out / "queue.sqlite")
    c = q.counts()
    assert c["leased"] == 0 and c["pending"] == int(m.group(1)) and c["done"] == ROWS - c["pending"], c
    q.close()
    p = kvbatch(out, args + ["worker.processes=2"])
    assert p.returncode == 0, p.stderr
    assert _tokens(out) == ref


def test_a_worker_whose_device_fails_fails_the_run_and_the_same_command_finishes(job, tmp_path):
    args, ref, _ = job
    out = tmp_path / "two"
    p = kvbatch(out, args + ["worker.processes=2", "worker.flush_rows=1", "debug.device_fault_after=30"])
    assert p.returncode == 1, p.stderr
    assert "kvbatch: error: the device stopped working: RuntimeError: injected device fault" in p.stderr, p.stderr
    assert not (out / "results.parquet").exists()
    p = kvbatch(out, args + ["worker.processes=2"])
    assert p.returncode == 0, p.stderr
    got = pq.read_table(out / "results.parquet").to_pylist()
    assert {r["row_key"]: (r["error_code"], r["output_token_ids"]) for r in got} == ref
    assert {r["attempt"] for r in got} == {1}  # the device's failure charged no row


def test_each_worker_gets_its_share_of_the_budget_and_its_own_id():
    cfg = Config(worker=WorkerConfig(processes=4, id="gpu0"))
    auto = worker_config(cfg, 2)
    assert auto.memory.fraction == pytest.approx(cfg.memory.fraction / 4)
    assert parse_size(auto.memory.headroom) == parse_size(cfg.memory.headroom) // 4
    assert (auto.worker.processes, auto.worker.id, auto.memory.limit_allocator) == (1, "gpu0-2", True)
    fixed = worker_config(replace(cfg, memory=MemoryConfig(budget="8GiB")), 0)
    assert fixed.memory.budget_bytes == 2 * 2**30
    assert worker_config(Config(worker=WorkerConfig(processes=2)), 1).worker.id is None  # each its own


def test_processes_must_be_positive_and_not_with_shards():
    with pytest.raises(ConfigError, match="worker.processes=0: must be >= 1"):
        compose_config(["model=tiny", "worker.processes=0"])
    with pytest.raises(ConfigError, match="worker.processes=2: a sharded job .* runs one process a shard"):
        compose_config(["model=tiny", "worker.processes=2", "queue.shards=3"])


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_workers_progress_reaches_the_front_in_few_messages_and_adds_up(tmp_path):
    clock, sent = _Clock(), tmp_path / "relay"
    with open(sent, "w") as f:
        relay = Relay(f, clock)
        for _ in range(100):  # a hundred engine steps within RELAY_S: nothing sent yet
            relay.tokens(3)
        clock.t = 1.0
        relay.speculation = (40, 30)
        relay.row_done(5, 19)  # ... then one line with all of it
        relay.tokens(2)
        relay.close()
    lines = [json.loads(x) for x in sent.read_text().splitlines()]
    assert [(m.get("tokens"), m.get("rows"), m.get("spec")) for m in lines] == [(300, [[5, 19]], [40, 30]),
                                                                               (2, None, [40, 30])]
    progress = Progress(4, 1000, mode="off")
    front = Workers(Config(worker=WorkerConfig(processes=2)), progress)
    for i, msgs in enumerate((lines, [{"tokens": 10, "rows": [[0, 24]], "spec": [10, 5], "rss": 7}])):
        for m in msgs:
            front._take(i, m)
    assert (progress.done_tokens, progress.rows, progress.total) == (312, 2, 995)
    assert progress.speculation == (50, 35)  # both workers' proposals, each worker's latest


LONG = ["job.ignore_eos=true", "job.max_tokens=800", "worker.processes=2"]


def _when_workers_hold_rows(args, out, n: int):
    """The command started on a long job (stderr in out's folder), returned once `n` of its workers hold rows (the
    state, polled: up to 120 s), with the pids of the workers holding rows."""
    front = start(out, args, out.parent / "front.log")
    for _ in range(1200):
        if (out / "queue.sqlite").exists():
            q = Queue(out / "queue.sqlite")
            holding = {r[2] for r in q.attempts() if r[5] is None}
            pids = [s["pid"] for s in q.sessions() if s["worker"] in holding]
            q.close()
            if len(pids) >= n:
                return front, pids
        if front.poll() is not None:
            raise AssertionError((out.parent / "front.log").read_text())
        time.sleep(0.1)
    front.kill()
    raise AssertionError("the workers never held rows")


def test_sigterm_to_the_command_stops_every_worker_and_the_same_command_continues(job, tmp_path):
    """SIGTERM reaches the command alone (its workers run in their own session, as a terminal's Ctrl-C would): it
    hands the stop to each worker, which checkpoints its rows and hands them back; the command exits 143, no
    worker is left running, and the same command finishes the job without charging a row."""
    args = job[0] + LONG
    out = tmp_path / "two"
    front, _ = _when_workers_hold_rows(args, out, 2)
    try:
        front.terminate()
        front.wait(timeout=120)
    finally:
        front.kill()
    err = (out.parent / "front.log").read_text()
    assert front.returncode == 143, err
    assert err.count("kvbatch: terminated; finished rows are saved") >= 1, err
    q = Queue(out / "queue.sqlite")
    assert q.counts()["leased"] == 0 and {s["stop"] for s in q.sessions()} == {"interrupted"}, q.sessions()
    left = [s["worker"] for s in q.sessions() if procs.alive(s["pid"], s["started_at"])]
    q.close()
    assert not left  # every worker ended before the command did
    p = kvbatch(out, args)
    assert p.returncode == 0, p.stderr
    got = pq.read_table(out / "results.parquet").to_pylist()
    assert len(got) == ROWS and {r["error_code"] for r in got} == {None} and {r["attempt"] for r in got} == {1}


def test_a_killed_worker_fails_the_run_in_one_line_and_loses_no_row(job, tmp_path):
    """kill -9 of one worker (what the kernel's OOM killer does): the other worker goes on, the command exits 1 with
    one line naming the kill, and the same command finishes the job: every row once, none charged."""
    args = job[0] + LONG
    out = tmp_path / "two"
    front, pids = _when_workers_hold_rows(args, out, 1)
    try:
        os.kill(pids[0], 9)
        front.wait(timeout=300)
    finally:
        front.kill()
    err = (out.parent / "front.log").read_text()
    assert front.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvbatch: error: worker process ") and "was killed by SIGKILL" in last, err
    p = kvbatch(out, args)
    assert p.returncode == 0, p.stderr
    got = pq.read_table(out / "results.parquet").to_pylist()
    assert sorted(r["row_key"] for r in got) == [f"r{i:02d}" for i in range(ROWS)]
    assert {r["error_code"] for r in got} == {None} and {r["attempt"] for r in got} == {1}
