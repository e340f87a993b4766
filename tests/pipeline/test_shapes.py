"""ShareGPT and Alpaca rows mapped to kvbatch's columns and generated; a mapping naming a missing column stops
the run at start with one line."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import ConfigError

SHAREGPT = [{"id": "s1", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Hi"},
                                           {"from": "gpt", "value": "old answer"}]},
            {"id": "s2", "conversations": [{"from": "human", "value": "Yo"}], "source": "web"},
            {"id": "s3", "conversations": [{"from": "robot", "value": "?"}]}]
ALPACA = [{"id": "a1", "instruction": "Add", "input": "2 and 3", "output": "5"},
          {"id": "a2", "instruction": "Say hi", "input": "", "output": "hi"},
          {"id": "a3", "instruction": "", "input": "x"}]


@pytest.fixture
def run(tmp_path, model_cache_dir, capsys):
    def go(rows, *overrides):
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        path = actions.execute(compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}",
                                               f"output.root={tmp_path / 'out'}", "output.progress=off",
                                               f"job.input={src}", "job.max_tokens=3", *overrides]))
        capsys.readouterr()
        return {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    return go


def test_sharegpt_and_alpaca_rows_are_mapped_and_generated(run):
    by = run(SHAREGPT, "job.shape=sharegpt")
    assert by["s1"]["error_code"] is None and by["s1"]["messages"] == [  # the old answer is regenerated
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": by["s1"]["output"]}]
    assert by["s2"]["output_tokens"] > 0 and by["s2"]["source"] == "web" and "conversations" not in by["s2"]
    assert by["s3"]["error_code"] == "invalid_input" and "from='robot'" in by["s3"]["error_message"]
    by = run(ALPACA, "job.shape=alpaca")
    assert by["a1"]["messages"][0] == {"role": "user", "content": "Add\n\n2 and 3"}
    assert by["a2"]["messages"][0] == {"role": "user", "content": "Say hi"}
    assert by["a1"]["input_output"] == "5" and by["a1"]["error_code"] is None  # the reference answer carried
    assert by["a3"]["error_code"] == "invalid_input" and "instruction must be a non-empty" in by["a3"]["error_message"]


@pytest.mark.parametrize("rows,overrides,needle", [
    (SHAREGPT, ["job.shape=sharegpt", "job.sharegpt_column=turns"], "job.sharegpt_column='turns': no such column"),
    (ALPACA, ["job.shape=alpaca", "job.alpaca_instruction=task"], "job.alpaca_instruction='task': no such column"),
    (ALPACA, ["job.shape=alpaca", "job.alpaca_input=context"], "job.alpaca_input='context': no such column"),
])
def test_a_mapping_naming_a_missing_column_is_one_line_at_start(run, monkeypatch, rows, overrides, needle):
    monkeypatch.setattr(actions, "load_runtime", lambda cfg: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=needle) as err:
        run(rows, *overrides)
    assert "\n" not in str(err.value)
