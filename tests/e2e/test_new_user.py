"""What a new user trips over (issue 22), through the command as they run it."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from tests.e2e.test_pipeline_cli import run_cli as kvbatch  # the entry point, in process


def _tiny(tmp_path, model_cache_dir, *more):
    return ("model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}", *more)


def test_stop_newline_from_the_command_line_stops(tmp_path, model_cache_dir):
    """The tiny model answers the sample prompts with newlines; `job.stop=['\\n']` typed in a shell
    must stop there (it used to arrive as a backslash and an n, and never match)."""
    p = kvbatch(*_tiny(tmp_path, model_cache_dir, "job.max_tokens=24", r"job.stop=['\n']"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = pq.read_table(Path(p.stdout.strip().splitlines()[-1])).to_pylist()
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(stopped) >= 5, [(r["output"], r["finish_reason"]) for r in rows]
    assert all("\n" not in r["output"] and r["output_tokens"] <= 1 for r in stopped)


def test_exit_status_when_rows_fail(tmp_path, model_cache_dir):
    """Every row failed: results.parquet is written (its path the last stdout line), exit 1. Some
    failed: exit 0 unless more than output.max_error_fraction of the rows did."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": ""}\n{"id": "b", "prompt": "   "}\n')
    p = kvbatch(*_tiny(tmp_path, model_cache_dir, f"job.input={bad}"), cwd=tmp_path)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "kvbatch: error: no row succeeded: 2 of 2 rows ended with an error code (invalid_input 2)" in p.stderr
    assert pq.read_table(Path(p.stdout.strip().splitlines()[-1])).num_rows == 2

    half = tmp_path / "half.jsonl"
    half.write_text('{"id": "a", "prompt": ""}\n{"id": "b", "prompt": "hello"}\n')
    args = _tiny(tmp_path, model_cache_dir, f"job.input={half}", "job.max_tokens=4")
    assert kvbatch(*args, cwd=tmp_path).returncode == 0
    strict = kvbatch(*args, "output.max_error_fraction=0.4", cwd=tmp_path)  # same folder: nothing to generate
    assert strict.returncode == 1 and "more than output.max_error_fraction=0.4" in strict.stderr, strict.stderr
    assert kvbatch(*args, "output.max_error_fraction=0.5", cwd=tmp_path).returncode == 0


def _rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_status_and_finalize_find_the_job_by_name(tmp_path, model_cache_dir):
    """The job ran with job.max_tokens=3 (part of the config hash); status without it used to say
    'no queue yet'. One folder: used. Several: listed; finalize asks for output.dir."""
    run = kvbatch(*_tiny(tmp_path, model_cache_dir, "job.max_tokens=3"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    folder = Path(run.stdout.strip().splitlines()[-1]).parent
    st = kvbatch(*_tiny(tmp_path, model_cache_dir, "action=status"), cwd=tmp_path)
    assert st.returncode == 0 and f"queue: {folder / 'queue.sqlite'}" in st.stdout, (st.stdout, st.stderr)
    assert "rows: 8 total; pending 0, leased 0, done 8, error 0" in st.stdout
    assert "using the only folder of job 'sample'" in st.stderr
    fin = kvbatch(*_tiny(tmp_path, model_cache_dir, "action=finalize"), cwd=tmp_path)
    assert fin.returncode == 0 and fin.stdout.strip().splitlines()[-1] == str(folder / "results.parquet")

    other = kvbatch(*_tiny(tmp_path, model_cache_dir, "job.max_tokens=2", "kv=q8"), cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    both = kvbatch(*_tiny(tmp_path, model_cache_dir, "action=status"), cwd=tmp_path)
    assert both.returncode == 0 and "job 'sample' has 2 folders" in both.stderr, both.stderr
    listed = [ln for ln in both.stdout.splitlines() if ln.strip()]
    assert len(listed) == 2 and any(str(folder) in ln and "kv=none" in ln for ln in listed), listed
    assert any("kv=q8" in ln and "8 done" in ln for ln in listed), listed
    which = kvbatch(*_tiny(tmp_path, model_cache_dir, "action=finalize"), cwd=tmp_path)
    assert which.returncode == 2 and "has 2 folders" in which.stderr and "output.dir=" in which.stderr
    exact = kvbatch(*_tiny(tmp_path, model_cache_dir, "action=finalize", "job.max_tokens=3"), cwd=tmp_path)
    assert exact.returncode == 0 and exact.stdout.strip().splitlines()[-1] == str(folder / "results.parquet")


def test_retry_requeues_error_rows_and_the_results_keep_only_the_new_outcome(tmp_path, model_cache_dir):
    """A budget too small for most rows (memory settings are not part of the config hash), then
    action=retry retry.codes=[insufficient_memory], then the job again with room: every row ok, once."""
    args = _tiny(tmp_path, model_cache_dir, "job.max_tokens=8")
    small = kvbatch(*args, "memory.budget=3MiB", cwd=tmp_path)
    assert small.returncode == 0, small.stderr
    path = Path(small.stdout.strip().splitlines()[-1])
    refused = {r["row_key"] for r in _rows(path) if r["error_code"] == "insufficient_memory"}
    assert refused and len(refused) < 8

    none = kvbatch(*args, "action=retry", "retry.codes=[internal_error]", cwd=tmp_path)
    assert none.returncode == 0 and "0 error rows (internal_error) queued again" in none.stdout
    again = kvbatch(*args, "action=retry", "retry.codes=[insufficient_memory]", cwd=tmp_path)
    assert again.returncode == 0 and f"{len(refused)} error rows (insufficient_memory) queued again" in again.stdout
    fin = kvbatch(*args, "action=finalize", cwd=tmp_path)  # before the rerun: the old errors are gone
    assert fin.returncode == 0, fin.stderr
    assert not refused & {r["row_key"] for r in _rows(path)}  # not taken back from their old part
    assert len(_rows(path)) == 8 - len(refused) and "remaining" in fin.stdout

    rerun = kvbatch(*args, cwd=tmp_path)
    assert rerun.returncode == 0 and "8 rows (8 ok)" in rerun.stdout, rerun.stdout + rerun.stderr
    assert "rows refused for memory run again" not in rerun.stderr  # action=retry requeued them, not the budget
    rows = _rows(path)
    assert len(rows) == 8 and len({r["row_key"] for r in rows}) == 8
    assert all(r["error_code"] is None and r["attempt"] == 1 for r in rows if r["row_key"] in refused)
    bad = kvbatch(*args, "action=retry", "retry.codes=[oom]", cwd=tmp_path)
    assert bad.returncode == 2 and "retry.codes=['oom']: choose among invalid_input" in bad.stderr
