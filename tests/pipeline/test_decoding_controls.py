"""Issue 24 through the pipeline (tiny model): logprobs, prompt_logprobs, constrained output and the
vLLM sampling controls, job level and per row, and their results.parquet columns."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline.config import ConfigError
from kvbatch.pipeline.results import SCHEMA
from tests.pipeline.test_pipeline import run_app  # noqa: F401  (fixture)
from tests.pipeline.files import write_jsonl as _jsonl

ENUM = {"enum": ["yes", "no", "maybe"]}



def test_columns_and_per_row_controls(run_app, tmp_path):  # noqa: F811
    schema_file = tmp_path / "enum.json"
    schema_file.write_text(json.dumps(ENUM))
    src = _jsonl(tmp_path, [
        {"id": "lp", "prompt": "Once upon", "logprobs": 3, "prompt_logprobs": True},
        {"id": "re", "prompt": "Once upon", "response_format": "regex:[ab]{3}-(yes|no)", "temperature": 1.0},
        {"id": "enum_text", "prompt": "Once upon", "response_format": json.dumps(ENUM)},
        {"id": "enum_file", "prompt": "Once upon", "response_format": str(schema_file)},
        {"id": "free", "prompt": "Once upon"},
        {"id": "pen", "prompt": "Once upon", "repetition_penalty": 1.5, "presence_penalty": -0.5,
         "frequency_penalty": 0.5, "min_p": 0.1, "min_tokens": 3, "ignore_eos": True, "stop_token_ids": [1, 2]},
        {"id": "bad_schema", "prompt": "x", "response_format": {"type": "foo"}},
        {"id": "bad_file", "prompt": "x", "response_format": "no/such/schema.json"},
        {"id": "bad_pen", "prompt": "x", "presence_penalty": 2.5},
        {"id": "bad_lp", "prompt": "x", "logprobs": 21},
        {"id": "bad_ids", "prompt": "x", "stop_token_ids": [-3]},
        {"id": "bad_bool", "prompt": "x", "ignore_eos": "maybe"},
        {"id": "bad_min", "prompt": "x", "min_tokens": 50},  # above its max_tokens: the engine refuses it
    ])
    path, _ = run_app(f"job.input={src}", "job.max_tokens=12", "job.chat_template=false")
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == SCHEMA
    assert table.schema.field("top_logprobs").type == pa.list_(pa.list_(pa.struct(
        [("token_id", pa.int32()), ("logprob", pa.float32())])))
    assert table.schema.field("output_logprobs").type == pa.list_(pa.float32())
    rows = {r["row_key"]: r for r in table.to_pylist()}
    lp = rows["lp"]
    assert len(lp["output_logprobs"]) == lp["output_tokens"] == len(lp["top_logprobs"]) > 0
    assert all(len(t) == 3 and t[0]["logprob"] >= t[1]["logprob"] >= t[2]["logprob"] for t in lp["top_logprobs"])
    assert [t[0]["token_id"] for t in lp["top_logprobs"]] == lp["output_token_ids"]  # greedy: the best one
    assert lp["cumulative_logprob"] == pytest.approx(sum(lp["output_logprobs"]), abs=1e-4)
    assert len(lp["prompt_logprobs"]) == lp["prompt_tokens"] - 1 and all(v <= 0 for v in lp["prompt_logprobs"])
    assert lp["logprobs"] == 3 and rows["free"]["output_logprobs"] is None and rows["free"]["logprobs"] == 0
    assert re.fullmatch(r"[ab]{3}-(yes|no)", rows["re"]["output"]) and rows["re"]["finish_reason"] == "stop"
    assert json.loads(rows["enum_text"]["output"]) in ENUM["enum"]
    assert json.loads(rows["enum_text"]["response_format"]) == ENUM
    assert rows["free"]["response_format"] is None
    pen = rows["pen"]
    assert pen["error_code"] is None and pen["output_tokens"] >= 3
    assert (pen["repetition_penalty"], pen["presence_penalty"], pen["frequency_penalty"], pen["min_p"]) == \
        (1.5, -0.5, 0.5, pytest.approx(0.1))
    assert (pen["min_tokens"], pen["ignore_eos"], pen["stop_token_ids"]) == (3, True, [1, 2])
    expect = {"bad_schema": "response_format rejected by llguidance: Invalid type: foo",
              "bad_file": "a row never names a file", "enum_file": "a row never names a file",
              "bad_pen": "presence_penalty must be in [-2, 2]",
              "bad_lp": "logprobs must be in [0, 20]", "bad_ids": "stop_token_ids must be a list of token ids",
              "bad_bool": "ignore_eos must be true or false", "bad_min": "min_tokens must be in [0, max_tokens=12]"}
    for key, msg in expect.items():
        assert rows[key]["error_code"] == "invalid_input" and msg in rows[key]["error_message"], rows[key]
    for key in ("response_format", "logprobs", "ignore_eos"):
        assert f"input_{key}" not in table.column_names  # used, not carried


def test_job_level_controls_csv_rows_and_stop_reason(run_app, tmp_path):  # noqa: F811
    src = tmp_path / "in.csv"
    src.write_text('id,prompt,response_format,stop_token_ids,ignore_eos\n'
                   'a,Once upon,,,\n'
                   'b,Once upon,text,,\n'
                   'c,Once upon,"{""enum"": [""x"", ""y""]}","[1, 2]",true\n')
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(ENUM))
    path, _ = run_app(f"job.input={src}", "job.max_tokens=12", "job.chat_template=false",
                      f"job.response_format={schema}", "sampling.logprobs=1")
    rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    assert json.loads(rows["a"]["output"]) in ENUM["enum"] and len(rows["a"]["top_logprobs"][0]) == 1
    assert rows["b"]["response_format"] is None  # "text": free output in a constrained job
    assert json.loads(rows["c"]["output"]) in ("x", "y") and rows["c"]["stop_token_ids"] == [1, 2]
    assert rows["c"]["ignore_eos"] is True
    # stop_token_ids: the row ends at that token, stop_reason says which
    free = rows["b"]["output_token_ids"]
    stop = next((t for j, t in enumerate(free) if j >= 1 and t not in free[:j]), free[0])
    path, _ = run_app(f"job.input={src}", "job.max_tokens=12", "job.chat_template=false",
                      f"job.stop_token_ids=[{stop}]")
    b = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}["b"]
    assert b["stop_reason"] == str(stop) and b["finish_reason"] == "stop"
    assert b["output_token_ids"] == free[:free.index(stop)]


def test_job_level_problems_only_the_model_can_see_fail_at_start(run_app, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match=r"job.stop_token_ids=\[99999\]: \[99999\] outside the model's vocabulary"):
        run_app("job.stop_token_ids=[99999]", "job.max_tokens=2")
