"""job.reasoning through the pipeline (tiny model, issue 45): results' reasoning and answer columns beside
the full output, the job's response format on the answer only, max_reasoning_tokens, the OpenAI batch
output's reasoning_content, and the config errors."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import ConfigError
from tests.pipeline.test_pipeline import run_app  # noqa: F401  (fixture)
from tests.pipeline.files import write_jsonl

ENUM = {"enum": ["yes", "no"]}


def test_reasoning_and_answer_columns_and_batch_output(run_app, tmp_path, caplog):  # noqa: F811
    src = write_jsonl(tmp_path, [{"id": f"r{i}", "prompt": f"Question {i}? <think>", "temperature": 1.0,
                                  "seed": i} for i in range(3)] + [{"id": "closed", "prompt": "Q <think></think>"}])
    schema = tmp_path / "enum.json"
    schema.write_text(json.dumps(ENUM))
    path, _ = run_app(f"job.input={src}", "job.chat_template=false", "job.max_tokens=30",
                        "job.reasoning='<think>,</think>'", "job.max_reasoning_tokens=5",
                        f"job.response_format={schema}", "output.openai_batch=true")
    assert "reasoning: <think> ... </think>" in caplog.text
    rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    for i in range(3):
        r = rows[f"r{i}"]
        assert r["error_code"] is None and r["finish_reason"] == "stop"
        assert r["output"] == r["reasoning"] + "</think>" + r["answer"]
        assert json.loads(r["answer"]) in ENUM["enum"]
    closed = rows["closed"]  # its prompt closed the block: the whole output is the answer, constrained
    assert closed["reasoning"] is None and closed["answer"] == closed["output"]
    assert json.loads(closed["answer"]) in ENUM["enum"]
    lines = {x["custom_id"]: x for x in map(json.loads, (path.parent / "batch_output.jsonl").read_text().splitlines())}
    msg = lines["r0"]["response"]["body"]["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"]) == (rows["r0"]["answer"], rows["r0"]["reasoning"])


@pytest.mark.parametrize("overrides,why", [
    (["job.reasoning='<think>'"], "job.reasoning='<think>': must be auto, none or START,END"),
    (["job.reasoning=none", "job.max_reasoning_tokens=4"], "needs reasoning tags"),
    (["job.reasoning='<a>,</a>'", "job.max_reasoning_tokens=300"], "below job.max_tokens"),
])
def test_bad_reasoning_settings_fail_in_one_line(overrides, why):
    with pytest.raises(ConfigError, match=why):
        compose_config(["model=tiny", *overrides])


def test_auto_without_tags_refuses_max_reasoning_tokens(run_app, tmp_path):  # noqa: F811
    src = write_jsonl(tmp_path, [{"id": "a", "prompt": "Hi"}])
    with pytest.raises(ConfigError, match="writes no reasoning tags"):
        run_app(f"job.input={src}", "job.max_reasoning_tokens=4")
