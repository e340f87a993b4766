"""The command as a user runs it (subprocess): exit codes, one-line errors, the last stdout line.

`run_cli` runs the same entry point in this process, for the tests of what the command does with its
arguments (the subprocess tests here cover the process itself: start-up, imports, nothing else printed)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]


def kvbatch(*args, cwd):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "kvbatch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def run_cli(*args, cwd) -> subprocess.CompletedProcess:
    """`kvbatch ARGS` through its entry point (kvbatch.pipeline.cli.main) in this process, from `cwd`:
    its exit status (SystemExit's code), stdout and stderr, as `kvbatch()` returns them. Saves a
    Python start-up, the imports and the model's first load per call."""
    from kvbatch.pipeline import cli

    out, err, argv, here = io.StringIO(), io.StringIO(), sys.argv, os.getcwd()
    code = 0
    try:
        os.chdir(cwd)
        sys.argv = ["kvbatch", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
        os.chdir(here)
    return subprocess.CompletedProcess(["kvbatch", *args], code, out.getvalue(), err.getvalue())


def test_main_job_runs_and_resumes(tmp_path, model_cache_dir):
    t0 = time.perf_counter()
    args = ("model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}")
    p = kvbatch(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert time.perf_counter() - t0 < 60
    path = Path(p.stdout.strip().splitlines()[-1])
    assert path.name == "results.parquet" and pq.read_table(path).num_rows == 8
    assert "8 rows (8 ok)" in p.stdout
    again = kvbatch(*args, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == str(path)
    assert "nothing to generate" in again.stderr


BAD = [
    ("kv=q3", "kv=q3: no such option"),
    ("memory.budget=lots", "memory.budget='lots'"),
    ("job.max_tokens=-1", "job.max_tokens=-1"),
    ("job.max_tokenz=5", "job.max_tokenz: unknown key (did you mean job.max_tokens?)"),
    ("+sampling.typical_p=0.9", "sampling.typical_p: unknown key"),
    ("job.response_format={type:foo}", "response_format rejected by llguidance: Invalid type: foo"),
    ("job.input=missing.jsonl", "no such file"),
    ("job.input=data.txt", "cannot tell the format"),
    ("job.input=nocol.jsonl", "job.prompt_column='prompt': no such column"),
]


@pytest.mark.parametrize("override,needle", BAD)
def test_bad_config_or_input_is_one_line_before_the_model_loads(tmp_path, override, needle):
    _one_line_before_the_model_loads(run_cli, tmp_path, override, needle)


@pytest.mark.parametrize("override,needle", [BAD[0], BAD[-1]])  # refused in composition; in the job's input
def test_bad_config_or_input_is_one_line_in_a_process_of_its_own(tmp_path, override, needle):
    """The same in a real process: nothing else (an import, a warning) writes to stderr."""
    _one_line_before_the_model_loads(kvbatch, tmp_path, override, needle)


def _one_line_before_the_model_loads(run, tmp_path, override, needle):
    (tmp_path / "data.txt").write_text("hello\n")
    (tmp_path / "nocol.jsonl").write_text('{"text": "hi"}\n')
    # A model that cannot load: any of these errors must come before it is tried.
    p = run("model=local", "model.path=/nonexistent/model", f"output.root={tmp_path / 'out'}",
                override, cwd=tmp_path)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvbatch: error: ") and needle in lines[0], p.stderr
    assert p.stdout == ""
