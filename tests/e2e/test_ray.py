"""kvbatch.ray on a real local Ray cluster (tests/e2e/ray_pipeline.py), the tiny model, 50 rows.

Ray finds its own IP address by probing an outside one, so the cluster runs inside a network namespace
that has only a loopback interface (`unshare -n`, `lo` brought up with iproute2's `ip`): nothing it
does can reach beyond this machine. The command runs the same rows at the same time, outside it, for
the reference. One actor dies mid-batch (SIGKILL at a decode step) and Ray runs its batch again.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from kvbatch.engine.errors import INVALID_INPUT, KvbatchConfigError

HERE = Path(__file__).resolve().parent
BAD = {"r07": "", "r31": ""}  # empty prompts: invalid_input
TOO_MANY = "r40"  # a per-row max_tokens beyond the engine's range: invalid_input
ROWS = [{"id": f"r{i:02d}", "prompt": BAD.get(f"r{i:02d}", f"word{i} " * (1 + i % 4)),
         "max_tokens": 2**40 if f"r{i:02d}" == TOO_MANY else 2 + i % 6, "tag": i % 3} for i in range(50)]


def _ip() -> str:
    found = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)
    assert found, "iproute2's `ip` is missing: `make system-deps` installs it"
    return found


@pytest.fixture(scope="module")
def ran(tmp_path_factory, model_cache_dir):
    """(the dataset Ray wrote, the command's results by key, what the pipeline reported)."""
    d = tmp_path_factory.mktemp("ray")
    src = d / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RAY_USAGE_STATS_ENABLED": "0"}
    pipeline = subprocess.Popen(
        ["unshare", "-n", "sh", "-c", f'"{_ip()}" link set lo up && exec "$0" "$@"', sys.executable,
         str(HERE / "ray_pipeline.py"), str(src), str(d), str(model_cache_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cli = subprocess.run([sys.executable, "-m", "kvbatch", "model=tiny", f"model.cache_dir={model_cache_dir}",
                          f"job.input={src}", f"output.dir={d / 'cli'}", "job.max_tokens=8", "job.chat_template=false",
                          "output.progress=off"], env=env, capture_output=True, text=True, timeout=300)
    out, err = pipeline.communicate(timeout=300)
    assert pipeline.returncode == 0, err[-4000:]
    assert cli.returncode == 0, cli.stderr
    report = json.loads(out.strip().splitlines()[-1])
    want = {r["row_key"]: r for r in pq.read_table(d / "cli" / "results.parquet").to_pylist()}
    return pads.dataset(d / "ray").to_table().to_pylist(), want, report


def test_the_dataset_holds_the_commands_tokens_and_error_codes(ran):
    got, want, _ = ran
    assert sorted(r["row_key"] for r in got) == sorted(want) == [r["id"] for r in ROWS]
    for r in got:
        w = want[r["row_key"]]
        assert (r["output_token_ids"], r["error_code"], r["finish_reason"]) == \
            (w["output_token_ids"], w["error_code"], w["finish_reason"]), r["row_key"]
        assert r["tag"] == int(r["row_key"][1:]) % 3  # the input's other columns come through
    errors = {r["row_key"]: r["error_code"] for r in got if r["error_code"]}
    assert errors == {k: INVALID_INPUT for k in (*BAD, TOO_MANY)}
    assert all(r["output_tokens"] > 0 for r in got if not r["error_code"])


def test_an_actor_killed_mid_batch_is_retried_without_duplicate_rows(ran):
    got, _, report = ran
    assert report == {"armed": True, "killed": True}  # the first actor died at its third decode step
    keys = [r["row_key"] for r in got]
    assert len(keys) == len(set(keys)) == len(ROWS)  # its batch ran again, once


def test_a_batch_that_cannot_run_comes_back_as_error_rows(model_cache_dir):
    import pyarrow as pa

    from kvbatch.ray import Generate

    with pytest.raises(KvbatchConfigError, match="max_tokenz"):
        Generate(model="tiny", max_tokenz=3, **{"model.cache_dir": str(model_cache_dir)})
    stage = Generate(model="tiny", max_tokens=3, **{"model.cache_dir": str(model_cache_dir)})
    out = stage({"id": ["a", "b"], "text": ["no prompt column", "here"]})  # a numpy-style batch: a dict
    assert out.column("row_key").to_pylist() == ["a", "b"] and out.column("text").to_pylist() == ["no prompt column",
                                                                                                   "here"]
    assert set(out.column("error_code").to_pylist()) == {INVALID_INPUT}
    assert "job.prompt_column" in out.column("error_message")[0].as_py()
    ok = stage(pa.table({"id": ["c"], "prompt": ["The cat"]}))
    assert ok.column("error_code").to_pylist() == [None] and ok.column("output_tokens").to_pylist() == [3]
