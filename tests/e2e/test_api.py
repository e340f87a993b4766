"""kvbatch.generate: the command's results from Python (a DataFrame, a list), resumable in its output folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest

import kvbatch
import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.config import ConfigError
from kvbatch.pipeline.results import COLUMNS

ROWS = [{"id": "a", "prompt": "The cat", "max_tokens": 3, "category": "x"},
        {"id": "b", "prompt": "Once upon a time", "temperature": 0.8, "seed": 5, "category": "y"},
        {"id": "c", "messages": [{"role": "user", "content": "Hi"}], "category": "z"},
        {"id": "d", "prompt": "", "category": "x"}]  # invalid_input in both


def test_generate_from_a_dataframe_equals_the_command(tmp_path, model_cache_dir, capsys):
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    cli = subprocess.run([sys.executable, "-m", "kvbatch", "model=tiny", f"model.cache_dir={model_cache_dir}",
                          f"job.input={src}", f"output.dir={tmp_path / 'cli'}", "job.max_tokens=6",
                          "job.system_prompt=Be brief."], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert cli.returncode == 0, cli.stderr
    want = pq.read_table(cli.stdout.strip().splitlines()[-1])
    got = kvbatch.generate(pd.DataFrame(ROWS), model="tiny", max_tokens=6, system_prompt="Be brief.",
                           output={"progress": "off"}, **{"model.cache_dir": str(model_cache_dir)})
    assert got.schema.names[:len(COLUMNS)] == COLUMNS and "category" in got.schema.names
    for col in ("row_key", "output", "output_token_ids", "finish_reason", "error_code", "messages", "category",
                "max_tokens", "temperature", "seed"):
        assert got.column(col).to_pylist() == want.column(col).to_pylist(), col
    assert got.column("error_code").to_pylist() == [None, None, None, "invalid_input"]
    capsys.readouterr()


def test_generate_resumes_in_its_output_folder(tmp_path, model_cache_dir, monkeypatch, capsys):
    opts = {"model": "tiny", "max_tokens": 4, "output": {"progress": "off"}, "model.cache_dir": str(model_cache_dir)}
    first = kvbatch.generate(["The cat", "A dog"], output_dir=tmp_path / "run", **opts)
    assert (tmp_path / "run" / "results.parquet").exists() and first.num_rows == 2
    monkeypatch.setattr(actions, "load_runtime", lambda cfg: pytest.fail("model loaded on a finished job"))
    again = kvbatch.generate(["The cat", "A dog"], output_dir=tmp_path / "run", **opts)
    assert again.column("output").to_pylist() == first.column("output").to_pylist()
    with pytest.raises(ConfigError, match=r"sampling.temprature: unknown key \(did you mean sampling.temperature"):
        kvbatch.generate(["x"], sampling={"temprature": 1.0}, **opts)
    with pytest.raises(ConfigError, match="temprature: unknown option"):
        kvbatch.generate(["x"], temprature=1.0, **opts)
    capsys.readouterr()


def test_generate_writes_nothing_to_stdout(model_cache_dir, capfd):
    """A library: no plan, summary or path of a temporary file on stdout (or stderr), progress off."""
    table = kvbatch.generate(["The cat"], model="tiny", max_tokens=2, **{"model.cache_dir": str(model_cache_dir)})
    assert table.num_rows == 1
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == "", captured
