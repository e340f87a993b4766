"""Issue 23 with real processes: a poison row takes no innocent row with it (defect 4), a full disk
stops the run with one line and charges no row (defect 12), and a kill loop (random `kill -9` of
a real worker, several rounds, then a final run) loses, duplicates, changes, strands and blames
nothing."""
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

from kvbatch.pipeline.queue import Queue
from tests.e2e.test_durable import check_files, kill_9_at, kvbatch, start

ROWS = [{"id": f"r{i:02d}", "prompt": f"word{i} " * (2 + i % 4), "max_tokens": [8, 24, 48][i % 3]}
        for i in range(12)]
KEYS = [r["id"] for r in ROWS]
SMALL = ["engine.max_batch=4", "engine.prefill_chunk=8", "worker.prefetch=2", "output.progress=off"]


@pytest.fixture(scope="module")
def job(tmp_path_factory, model_cache_dir):
    """(base args, reference results by key) of the 12-row job, run once uninterrupted."""
    d = tmp_path_factory.mktemp("stranded-job")
    src = d / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", "job.chat_template=false"]
    p = kvbatch(d / "ref", base + SMALL)
    assert p.returncode == 0, p.stderr
    ref = {r["row_key"]: r for r in pq.read_table(d / "ref" / "results.parquet").to_pylist()}
    assert list(ref) == KEYS and all(r["error_code"] is None for r in ref.values())
    return base, ref


def _results(out: Path) -> dict:
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["row_key"] for r in rows] == KEYS  # every row exactly once, in input order
    return {r["row_key"]: r for r in rows}


def test_4_a_poison_row_is_given_up_alone_and_no_batch_mate_is_charged(job, tmp_path):
    """Rows flushed only every 16 rows (the default): a row that finished alone used to stay unwritten
    and be charged with the poison row's next crash, until innocent rows were given up."""
    base, ref = job
    args = base + SMALL + ["worker.isolate_after=1", "worker.max_crashes=3", "worker.flush_s=1000"]
    out = tmp_path / "out"
    codes = []
    while not codes or codes[-1] != 0:
        assert len(codes) < 6, codes
        codes.append(kvbatch(out, args, crash="row:r05").returncode)
    rows = _results(out)
    bad = rows.pop("r05")
    for k, r in rows.items():
        assert (r["error_code"], r["output_token_ids"], r["attempt"]) == (None, ref[k]["output_token_ids"], 1), k
    assert codes == [-signal.SIGKILL] * 3 + [0]  # with batch mates once, then alone twice, then given up
    assert bad["error_code"] == "internal_error"
    assert "died 3 times while this row was running (2 of them with the row running alone)" in bad["error_message"]
    crashes = dict(Queue(out / "queue.sqlite").db.execute("SELECT key, crashes FROM rows WHERE crashes > 0"))
    assert crashes["r05"] == 3 and all(v == 1 for k, v in crashes.items() if k != "r05")
    assert check_files(out) == []


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_12_a_full_disk_stops_with_one_line_and_charges_no_row(job, tmp_path):
    base, ref = job
    fs = tmp_path / "fs"
    if not _mount_tmpfs(fs, "4m"):
        pytest.skip("needs root to mount a small tmpfs (a disk that really fills)")
    try:
        out = fs / "o"
        args = base + SMALL + ["worker.flush_rows=1"]
        assert kvbatch(out, args + ["action=enqueue"]).returncode == 0
        filler = fs / "filler"
        # fill the disk, then leave a little room: it fills mid-run (unbuffered: no write is pending at close)
        with open(filler, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
        os.truncate(filler, filler.stat().st_size - 96 * 1024)
        p = kvbatch(out, args + ["action=work"])
        assert p.returncode == 1, p.stderr
        errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("kvbatch: error: cannot write to"), p.stderr
        assert "Traceback" not in p.stderr
        filler.unlink()
        p = kvbatch(out, args)
        assert p.returncode == 0, p.stderr
        rows = _results(out)
        for k, r in rows.items():  # nothing charged: attempt 1, no error, same tokens
            assert (r["error_code"], r["attempt"], r["output_token_ids"]) == (None, 1, ref[k]["output_token_ids"]), k
        q = Queue(out / "queue.sqlite")
        assert q.crash_counts() == {"rows": 0, "max": 0, "retried": 0}
        assert "storage" in [s["stop"] for s in q.sessions()]
        q.close()
    finally:
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def kill_loop(out: Path, args: list[str], rounds: int, rng: random.Random, log_dir: Path) -> int:
    """`rounds` times: start a real worker and `kill -9` it at a random place: after 8 to 48 decode
    steps, 1 to 6 prefill chunks, or the first or second part's write or acknowledgement (a crash
    point pauses it there, so no round depends on how fast this machine is). Returns how many were
    killed."""
    killed = 0
    for i in range(rounds):
        point, lo, hi = rng.choice(KILL_POINTS)
        kill_9_at(out, args, f"{point}:{rng.randint(lo, hi)}:pause", log_dir / f"round{i}.err")
        killed += 1
        check_files(out)
    return killed


KILL_POINTS = [("decode", 8, 48), ("decode", 8, 48), ("prefill", 1, 6), ("part_tmp", 1, 2),
               ("after_part_write", 1, 2), ("after_ack", 1, 2)]
LOOP_ROWS = [{"id": f"k{i:02d}", "prompt": f"item{i} " * (1 + i % 5), "max_tokens": [16, 48, 96][i % 3]}
             for i in range(30)]  # >= 400 decode steps (4 rows a step): 5 rounds of a few rows all end mid-run


def test_kill_loop_loses_duplicates_changes_strands_and_blames_nothing(job, tmp_path):
    base, _ = job
    src = tmp_path / "loop.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in LOOP_ROWS))
    args = [a for a in base if not a.startswith("job.input=")] + [f"job.input={src}"] + SMALL + \
        ["worker.flush_rows=2", "worker.flush_s=1000"]
    p = kvbatch(tmp_path / "ref", args)
    assert p.returncode == 0, p.stderr
    ref = {r["row_key"]: r for r in pq.read_table(tmp_path / "ref" / "results.parquet").to_pylist()}
    out = tmp_path / "out"
    killed = kill_loop(out, args, rounds=5, rng=random.Random(23), log_dir=tmp_path)
    assert killed == 5
    final = kvbatch(out, args)
    assert final.returncode == 0, final.stderr
    rows = {r["row_key"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}
    assert list(rows) == [r["id"] for r in LOOP_ROWS]  # nothing lost, nothing duplicated, input order
    for k, r in rows.items():  # nothing changed, nothing charged to an innocent row
        assert (r["error_code"], r["output_token_ids"], r["attempt"]) == (None, ref[k]["output_token_ids"], 1), k
    q = Queue(out / "queue.sqlite")
    assert q.counts() == {"pending": 0, "leased": 0, "done": len(rows), "error": 0}  # nothing stranded
    assert sorted(r[0] for r in q.attempts() if r[5] in ("done", "error")) == sorted(rows)
    stops = [s["stop"] for s in q.sessions()]  # every round was killed mid-decode: all registered
    assert stops == ["died"] * killed + ["finished"], stops
    assert q.crash_counts()["max"] < 6
    assert check_files(out) == []


def test_a_surviving_worker_takes_over_the_rows_of_a_worker_killed_meanwhile(job, tmp_path):
    """Worker A holds rows and is killed while worker B runs: B does not exit with A's rows still
    leased (for worker.lease_s), it takes them over and the job ends complete (issue 23, also weak)."""
    base, ref = job
    args = base + SMALL + ["worker.flush_rows=1"]
    out = tmp_path / "out"
    assert kvbatch(out, args + ["action=enqueue"]).returncode == 0
    log_a = tmp_path / "a.err"
    a = start(out, args + ["action=work"], log_a, crash="decode:3:pause")  # A claims rows, then stops
    limit = time.monotonic() + 300
    while "kvbatch-debug: paused at" not in log_a.read_text():
        assert a.poll() is None and time.monotonic() < limit, log_a.read_text()
        time.sleep(0.05)
    log_b = tmp_path / "b.err"
    b = start(out, args + ["action=work"], log_b)
    while "memory plan:" not in log_b.read_text():  # B is past its start-up checks: A is alive then
        assert b.poll() is None and time.monotonic() < limit, log_b.read_text()
        time.sleep(0.05)
    os.kill(a.pid, signal.SIGKILL)
    a.wait(timeout=60)
    assert b.wait(timeout=300) == 0, log_b.read_text()
    q = Queue(out / "queue.sqlite")
    assert q.counts() == {"pending": 0, "leased": 0, "done": len(KEYS), "error": 0}
    rows = _results(out)
    assert all(r["output_token_ids"] == ref[k]["output_token_ids"] and r["attempt"] == 1 for k, r in rows.items())
