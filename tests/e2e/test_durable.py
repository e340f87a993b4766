"""The durable worker (issue 7), with real processes, real SQLite, real Parquet and the tiny model.

Every run is `python -m kvbatch ...` in its own process. Crashes are real SIGKILLs: the
testing-only crash points (pipeline/debug.py, KVBATCH_DEBUG_CRASH_AT=POINT:N:pause) stop
the worker at an exact place and the test sends `kill -9` from outside; `row:KEY` makes a
row kill its worker itself. Results are compared with one uninterrupted run of the same job.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline import checkpoints
from kvbatch.pipeline.debug import ENV as CRASH_ENV
from kvbatch.pipeline.parts import read_part
from kvbatch.pipeline.queue import Queue

# 17 rows: prompts of 2-10 prefill chunks (chunk 8), answers of 16 to 800 tokens, one invalid row.
MAX_TOKENS = [16, 64, 800, 32]
ROWS = [{"id": f"r{i:02d}", "prompt": f"word{i} " * (2 + 3 * (i % 5)), "max_tokens": MAX_TOKENS[i % 4]}
        for i in range(16)]
ROWS.insert(1, {"id": "bad", "prompt": ""})  # invalid_input: for status's error counts
KEYS = [r["id"] for r in ROWS]
SETTINGS = ["engine.max_batch=4", "engine.prefill_chunk=8", "worker.prefetch=2", "worker.flush_rows=2",
            "worker.flush_s=1000", "output.progress=off"]


@pytest.fixture(scope="module")
def job(tmp_path_factory, model_cache_dir):
    """(base args, reference results by key): the job, and one run of it never interrupted."""
    d = tmp_path_factory.mktemp("durable-job")
    src = d / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", "job.chat_template=false"]
    p = kvbatch(d / "ref", base + SETTINGS)
    assert p.returncode == 0, p.stderr
    ref = {r["row_key"]: r for r in pq.read_table(d / "ref" / "results.parquet").to_pylist()}
    assert list(ref) == KEYS and ref["bad"]["error_code"] == "invalid_input"
    assert all(ref[k]["error_code"] is None and ref[k]["output_tokens"] > 0 for k in KEYS if k != "bad")
    return base, ref


def _env(crash: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env["PYTHONWARNINGS"] = "ignore"
    if crash:
        env[CRASH_ENV] = crash
    return env


def kvbatch(out: Path, args: list[str], crash: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbatch", *args, f"output.dir={out}"], cwd=out.parent,
                          env=_env(crash), capture_output=True, text=True, timeout=600)


def start(out: Path, args: list[str], log: Path, crash: str | None = None) -> subprocess.Popen:
    with open(log, "w") as err, open(log.with_suffix(".out"), "w") as so:
        return subprocess.Popen([sys.executable, "-m", "kvbatch", *args, f"output.dir={out}"], cwd=out.parent,
                                env=_env(crash), stdout=so, stderr=err)


def kill_9_at(out: Path, args: list[str], crash: str, log: Path) -> str:
    """Run until the crash point `crash` (POINT:N:pause) pauses the worker, then `kill -9` it."""
    p = start(out, args, log, crash)
    limit = time.monotonic() + 300
    while "kvbatch-debug: paused at" not in (text := log.read_text()):
        if p.poll() is not None:
            pytest.fail(f"{crash}: the worker exited ({p.returncode}) before its crash point:\n{text}")
        if time.monotonic() > limit:
            p.kill()
            pytest.fail(f"{crash}: never reached\n{text}")
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    return text


def check_files(out: Path) -> list[Path]:
    """Every Parquet file in the output dir opens (parts verified: checksums, row count, keys),
    the queue passes SQLite's integrity check, summary.json parses. Returns leftover temporaries."""
    for f in out.rglob("*.parquet"):
        if "corrupt" in f.relative_to(out).parts:
            continue
        read_part(f) if f.parent.name == "parts" else pq.read_table(f)
    db = sqlite3.connect(out / "queue.sqlite")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    if (out / "summary.json").exists():
        json.loads((out / "summary.json").read_text())
    return sorted(out.rglob(".*.tmp"))


def check_results(out: Path, ref: dict, keys: list[str] = KEYS) -> list[dict]:
    """results.parquet: every input row exactly once, in input order, greedy outputs as the reference."""
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["row_key"] for r in rows] == keys
    for r in rows:
        if r["row_key"] not in ref:
            continue
        want = ref[r["row_key"]]
        assert (r["output_token_ids"], r["finish_reason"], r["error_code"]) == \
            (want["output_token_ids"], want["finish_reason"], want["error_code"]), r["row_key"]
    return rows


def rate_matches(rate: float, count: int, wall: float) -> bool:
    """`rate` (printed to 0.01) is `count` over a wall time printed as `wall` (to 0.1 s): true within the
    rounding, however short the run was."""
    lo = count / (wall + 0.05)
    hi = count / (wall - 0.05) if wall > 0.05 else float("inf")
    return lo - 0.005 <= rate <= hi + 0.005


def status(out: Path, args: list[str]) -> list[str]:
    p = kvbatch(out, args + ["action=status"])
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()


def test_kill_9_six_times_then_every_row_once_and_equal_to_an_uninterrupted_run(job, tmp_path):
    base, ref = job
    args = base + SETTINGS
    out = tmp_path / "out"
    schedule = [
        "prefill:3:pause",  # mid-prefill of the second row (more chunks to go)
        "decode:60:pause",  # mid-decode, two parts already acknowledged
        "after_part_write:2:pause",  # a part renamed into place, its rows not acknowledged
        "part_tmp:1:pause",  # a part's temporary written and fsynced, never renamed
        "decode:150:pause",
        "after_ack:1:pause",
    ]
    logs = []
    for i, crash in enumerate(schedule):
        logs.append(kill_9_at(out, args, crash, tmp_path / f"kill{i}.err"))
        temps = check_files(out)
        if crash.startswith("part_tmp"):
            assert [t.parent.name for t in temps] == ["parts"] and temps[0].name.startswith(".part-")
        if i == 0:  # status right after a kill: the dead worker still holds its rows
            lines = status(out, args)
            assert re.search(r"^workers on \S+: \S+ died \(pid \d+, 6 rows leased", "\n".join(lines), re.M), lines
            assert "remaining: 17 rows (11 pending, 6 leased)" in lines
            assert "runs: 1 worker sessions (died 1)" in lines
    # the run after the kill between part write and ack adopted that part's rows
    assert "were written by a stopped worker but not acknowledged; adopted" in logs[3]
    assert all("rows leased by dead workers on this host are back in the queue" in t for t in logs[1:])

    final = kvbatch(out, args)
    assert final.returncode == 0, final.stderr
    assert final.stdout.strip().splitlines()[-1] == str(out / "results.parquet")
    rows = check_results(out, ref)
    assert check_files(out) == []  # the dead writer's temporary is gone; no temp ever counted as a part
    assert not (out / "parts" / "corrupt").exists()
    assert all(r["attempt"] == 1 for r in rows)  # crashes did not use up attempts

    q = Queue(out / "queue.sqlite")
    crashes = dict(q.db.execute("SELECT key, crashes FROM rows"))
    assert sum(crashes.values()) > 0 and max(crashes.values()) < 6  # below worker.max_crashes
    assert max(crashes.values()) >= 3  # and some rows ran alone after 3 crashes (worker.isolate_after)
    stops = [s["stop"] for s in q.sessions()]
    assert stops == ["died"] * 6 + ["finished"]
    outcomes = [r[5] for r in q.attempts()]
    assert outcomes.count("worker_died") == sum(crashes.values())
    # exactly one acknowledged attempt per row; every other attempt ended because its worker died
    assert sorted(r[0] for r in q.attempts() if r[5] in ("done", "error")) == sorted(KEYS)
    # rows only claimed (or finished, not yet written) when their worker died are not charged a crash
    assert {"done", "error", "worker_died"} <= set(outcomes) <= {"done", "error", "worker_died",
                                                                 "worker_died_not_running"}
    lines = status(out, args)
    assert "remaining: none (every row has a result)" in lines
    assert "runs: 7 worker sessions (finished 1, died 6)" in lines
    most = max(crashes.values())
    n = sum(1 for v in crashes.values() if v)
    assert f"crashes: {n} rows were in flight when a worker died (one row up to {most}x; " \
           f"a row runs alone from 3, is given up at 6)" in lines


def test_two_workers_split_one_queue_and_no_row_runs_twice(job, tmp_path):
    base, ref = job
    args = base + SETTINGS + ["engine.max_batch=2", "worker.prefetch=1"]
    out = tmp_path / "out"
    p = kvbatch(out, args + ["action=enqueue"])
    assert p.returncode == 0 and "17 new of 17 rows queued" in p.stdout, p.stderr
    procs = [start(out, args + ["action=work"], tmp_path / f"w{i}.err") for i in range(2)]
    assert [w.wait(timeout=600) for w in procs] == [0, 0], [(tmp_path / f"w{i}.err").read_text() for i in range(2)]
    check_results(out, ref)
    assert check_files(out) == []
    q = Queue(out / "queue.sqlite")
    sessions = q.sessions()
    assert len(sessions) == 2 and all(s["stop"] == "finished" for s in sessions)
    a, b = sessions
    assert a["started_at"] < b["ended_at"] and b["started_at"] < a["ended_at"]  # they ran at the same time
    record = q.attempts()
    # the queue's record of who processed what: one claim per row, by one worker, acknowledged
    assert sorted(r[0] for r in record) == sorted(KEYS)
    assert all(r[5] in ("done", "error") and r[4] is not None for r in record)
    by_worker = {s["worker"]: sum(1 for r in record if r[2] == s["worker"]) for s in sessions}
    assert all(n > 0 for n in by_worker.values()) and sum(by_worker.values()) == 17, by_worker
    parts = {name: read_part(out / "parts" / name) for name in {r[6] for r in record}}
    for r in record:  # each row's part was written by the worker that claimed it
        assert set(parts[r[6]].column("worker").to_pylist()) == {r[2]}


def test_deadline_mid_run_exits_0_and_the_next_run_finishes(job, tmp_path):
    base, ref = job
    # one row at a time, one more claimed ahead; the deadline comes once 4 rows have a result (r00, bad, r01,
    # r02): at the same place on any machine, with r03 claimed and in flight
    args = base + SETTINGS + ["engine.max_batch=1", "worker.prefetch=1"]
    n = len(KEYS)
    out = tmp_path / "out"
    p = kvbatch(out, args + ["debug.deadline_after_rows=4"])
    assert p.returncode == 0, p.stderr
    m = re.search(r"deadline reached; (\d+) rows remain queued", p.stderr)
    assert m, p.stderr
    q = Queue(out / "queue.sqlite")
    c = q.counts()
    assert c["leased"] == 0 and c["pending"] == int(m.group(1)) == n - 4 and c["done"] == 3 and c["error"] == 1
    assert check_files(out) == []
    # rows done so far are in the parts (and in results.parquet); the rest is pending
    in_parts = {k for f in (out / "parts").glob("part-*.parquet") for k in read_part(f).column("row_key").to_pylist()}
    state = {k: s for _, k, s, _, _ in q.manifest()}
    assert in_parts == {k for k, s in state.items() if s in ("done", "error")} == {"r00", "bad", "r01", "r02"}
    assert pq.read_table(out / "results.parquet").column("row_key").to_pylist() == [k for k in KEYS if k in in_parts]
    # the deadline came mid-batch: the row in flight was handed back, not counted as an attempt
    handed = {r[0] for r in q.attempts() if r[5] == "deadline"}
    assert handed == {"r03"} and state["r03"] == "pending"
    assert q.sessions()[0]["stop"] == "deadline"

    lines = status(out, args)
    pending, done = c["pending"], c["done"]
    assert f"rows: {n} total; pending {pending}, leased 0, done {done}, error 1" in lines
    assert "errors: invalid_input 1" in lines
    assert f"remaining: {pending} rows ({pending} pending, 0 leased)" in lines
    last = next(ln for ln in lines if ln.startswith("last run: "))
    m = re.fullmatch(r"last run: \S+ deadline, (\d+) rows, (\d+) tokens in ([\d.]+)s \(([\d.]+) rows/s, "
                     r"([\d.]+) tokens/s\)", last)
    assert m, last
    assert int(m.group(1)) == done + 1  # with the invalid row
    assert int(m.group(2)) == sum(ref[k]["output_tokens"] for k in ("r00", "r01", "r02"))
    assert rate_matches(float(m.group(4)), int(m.group(1)), float(m.group(3)))
    assert "runs: 1 worker sessions (deadline 1)" in lines

    again = kvbatch(out, args)  # without the debug key: the same folder, the rest generated
    assert again.returncode == 0, again.stderr
    rows = check_results(out, ref)  # every row exactly once, the reference's outputs
    assert all(r["attempt"] == 1 for r in rows)
    lines = status(out, args)
    assert "remaining: none (every row has a result)" in lines
    assert "runs: 2 worker sessions (finished 1, deadline 1)" in lines
    assert any(re.fullmatch(r"last run: \S+ finished, \d+ rows, .*rows/s.*", ln) for ln in lines), lines


def test_corrupt_parts_left_by_a_crash_are_detected_and_their_rows_rerun(job, tmp_path):
    base, ref = job
    args = base + SETTINGS
    out = tmp_path / "out"
    kill_9_at(out, args, "after_part_write:2:pause", tmp_path / "kill.err")
    q = Queue(out / "queue.sqlite")
    first, second = sorted((out / "parts").glob("part-*.parquet"))
    acked = {k for _, k, s, part, _ in q.manifest() if part == first.name}
    unacked = set(read_part(second).column("row_key").to_pylist())
    assert len(acked) == 2 and len(unacked) == 2 and not acked & unacked
    # what power loss can leave: the acknowledged part truncated, the unacknowledged one torn
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    data = second.read_bytes()
    second.write_bytes(data[:100] + bytes(200) + data[300:])

    p = kvbatch(out, args)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("corrupt part moved to parts/corrupt/ (its rows run again)") == 2, p.stderr
    rows = check_results(out, ref)  # no row dropped, each exactly once, same outputs
    assert sorted(f.name for f in (out / "parts" / "corrupt").iterdir()) == [first.name, second.name]
    assert check_files(out) == []
    for k in acked:  # finished, its part lost: generated again, the lost run not counted
        assert [r[5] for r in q.attempts(k)] == ["lost_part", "error" if k == "bad" else "done"]
    for k in unacked:  # never acknowledged, its part unusable: its worker's claim ended with the crash
        # (after the row had finished: not charged)
        assert [r[5] for r in q.attempts(k)] == ["worker_died_not_running", "error" if k == "bad" else "done"]
    assert all(r["attempt"] == 1 for r in rows)


def test_a_row_that_kills_its_worker_every_time_is_given_up_alone(job, tmp_path):
    base, ref = job
    args = base + SETTINGS + ["worker.isolate_after=1", "worker.max_crashes=2"]
    out = tmp_path / "out"
    codes = []
    while not codes or codes[-1] != 0:
        assert len(codes) < 4, codes
        p = kvbatch(out, args, crash="row:r05")
        codes.append(p.returncode)
    # dies with batch mates, dies alone, then is written as internal_error without running
    assert codes == [-signal.SIGKILL, -signal.SIGKILL, 0]
    rows = {r["row_key"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}
    assert list(rows) == KEYS
    bad = rows.pop("r05")
    assert bad["error_code"] == "internal_error" and bad["finish_reason"] == "error"
    assert "died 2 times while this row was running (1 of them with the row running alone)" in bad["error_message"]
    assert "worker.max_crashes=2" in bad["error_message"]
    for k, r in rows.items():  # the batch mates of the first crash ran alone afterwards and finished
        assert r["output_token_ids"] == ref[k]["output_token_ids"] and r["attempt"] == 1
    q = Queue(out / "queue.sqlite")
    crashes = dict(q.db.execute("SELECT key, crashes FROM rows WHERE crashes > 0"))
    assert crashes["r05"] == 2 and all(v == 1 for k, v in crashes.items() if k != "r05") and len(crashes) > 1
    assert check_files(out) == []


def test_sigterm_writes_what_is_done_and_hands_the_rest_back(job, tmp_path):
    base, ref = job
    args = base + SETTINGS + ["engine.max_batch=1", "worker.prefetch=1"]
    out = tmp_path / "out"
    # the 200th decode step, one row at a time: r00 and bad are in a part, r01 is finished, r02 (800 tokens)
    # is mid-row and r03 claimed: the worker pauses there, on any machine, until SIGTERM comes
    p = start(out, args, tmp_path / "term.err", crash="decode:200:pause")
    limit = time.monotonic() + 300
    while "kvbatch-debug: paused at" not in (tmp_path / "term.err").read_text():
        assert p.poll() is None and time.monotonic() < limit, (tmp_path / "term.err").read_text()
        time.sleep(0.05)
    assert [f.name for f in (out / "parts").glob("part-*.parquet")]  # a first part: rows are done
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 143
    assert "kvbatch: terminated; finished rows are saved in parts/" in (tmp_path / "term.err").read_text()
    q = Queue(out / "queue.sqlite")
    c = q.counts()
    assert c["leased"] == 0 and c["pending"] == len(KEYS) - 3 and c["done"] == 2 and c["error"] == 1
    handed = {r[0] for r in q.attempts() if r[5] == "interrupted"}
    assert handed == {"r02", "r03"} and q.sessions()[0]["stop"] == "interrupted"
    assert q.crash_counts()["rows"] == 0  # handed back: no crash, no attempt
    assert check_files(out) == []
    assert "runs: 1 worker sessions (interrupted 1)" in status(out, args)
    assert kvbatch(out, args).returncode == 0
    assert all(r["attempt"] == 1 for r in check_results(out, ref))


def test_kill_9_mid_row_continues_from_its_last_checkpoint_and_counts_what_it_lost(tmp_path, model_cache_dir):
    """A real kill -9 with rows mid-answer: the next run continues each from its last checkpoint (at most
    checkpoint_every.tokens lost) and ends with the tokens of an uninterrupted run (made in this process).
    The tokens lost are counted: the killed worker's lease heartbeat recorded each row's tokens, and the
    run that takes the rows over adds up those beyond the checkpoints."""
    from kvbatch.pipeline import actions
    from kvbatch.pipeline.compose import compose_config
    from kvbatch.pipeline.status import lines

    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"id": f"k{i}", "prompt": f"kill {i} " * (i + 1)}) + "\n" for i in range(5)))
    every = 32
    args = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", "job.chat_template=false",
            "job.max_tokens=200", "job.ignore_eos=true", "engine.max_batch=4", "worker.prefetch=0",
            "output.progress=off", f"worker.checkpoint_every.tokens={every}", "worker.checkpoint_every.seconds=0",
            "worker.lease_s=3"]
    ref = {r["row_key"]: r for r in pq.read_table(actions.execute(compose_config(
        args + [f"output.dir={tmp_path / 'ref'}"]))).to_pylist()}
    out = tmp_path / "out"
    log = tmp_path / "kill.err"
    p = start(out, args, log, "decode:100:pause")
    limit = time.monotonic() + 300
    while "kvbatch-debug: paused at" not in log.read_text():
        assert p.poll() is None and time.monotonic() < limit, log.read_text()
        time.sleep(0.05)
    q = Queue(out / "queue.sqlite")

    def heartbeat() -> float:
        return q.db.execute("SELECT MAX(heartbeat_at) FROM workers").fetchone()[0] or 0.0

    seen = q.now()  # two lease renewals after the pause: the second one read the paused rows' tokens
    for _ in range(2):
        while (hb := heartbeat()) <= seen:
            assert time.monotonic() < limit
            time.sleep(0.05)
        seen = hb
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    held = dict(checkpoints.in_progress(q))
    assert len(held) == 4 and all(n >= 2 * every and n % every == 0 for n in held.values()), held
    assert any(line.startswith(f"in progress: 4 rows keep {sum(held.values())} tokens") for line in lines(q, 3, 6))
    made = dict(q.db.execute("SELECT key, generated FROM rows WHERE state='leased'").fetchall())
    assert set(made) == set(held) and all(held[k] <= made[k] < held[k] + every for k in held), (made, held)
    lost = sum(made[k] - held[k] for k in held)
    assert lost > 0
    q.close()
    final = kvbatch(out, args)
    assert final.returncode == 0, final.stderr
    rows = {r["row_key"]: r for r in check_results(out, ref, list(ref))}
    assert {k: r["resumed_tokens"] for k, r in rows.items() if r["resumed_tokens"]} == held
    for k in held:  # a checkpoint every 32 tokens, over both runs
        assert rows[k]["checkpoints"] == (rows[k]["output_tokens"] - 1) // every
    assert f"{sum(held.values())} carried over from checkpoints, {lost} lost" in final.stdout
    run = json.loads((out / "summary.json").read_text())["this_run"]
    assert (run["tokens_carried_over"], run["tokens_lost"]) == (sum(held.values()), lost)
