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
