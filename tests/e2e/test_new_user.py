"""What a new user trips over (issue 22), through the command as they run it."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from tests.e2e.test_pipeline_cli import kvbatch


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
