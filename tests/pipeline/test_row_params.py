"""Per-row sampling parameters and carried-through columns (issue 22.2): every sampling parameter a job
accepts is accepted per row, with the same checks; input columns kvbatch does not use come back in
results.parquet unchanged."""
from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq

from tests.pipeline.test_pipeline import run_app  # noqa: F401  (fixture)


def _jsonl(tmp_path, rows, name="in.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_per_row_top_k_top_p_and_stop_are_used(run_app, tmp_path):  # noqa: F811
    src = _jsonl(tmp_path, [
        {"id": "greedy", "prompt": "Once upon a time"},
        {"id": "top_k_1", "prompt": "Once upon a time", "temperature": 1.0, "top_k": 1, "seed": 7},
        {"id": "sampled", "prompt": "Once upon a time", "temperature": 1.0, "seed": 7},
        {"id": "top_p", "prompt": "Once upon a time", "temperature": 1.0, "top_p": 1e-6, "seed": 7},
        {"id": "nl", "prompt": "Tell me a long story."},
        {"id": "nl_stop", "prompt": "Tell me a long story.", "stop": "."},
        {"id": "csv_style_stop", "prompt": "Tell me a long story.", "stop": "[\".\", \"zz\"]"},
    ])
    path, _ = run_app(f"job.input={src}", "job.max_tokens=24", "job.chat_template=false")
    rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    greedy = rows["greedy"]["output_token_ids"]
    # top_k=1 (and a tiny top_p) leave one candidate: sampling at temperature 1 gives the greedy tokens
    assert rows["top_k_1"]["output_token_ids"] == greedy and rows["top_k_1"]["top_k"] == 1
    assert rows["top_p"]["output_token_ids"] == greedy and rows["top_p"]["top_p"] == 1e-6
    assert rows["sampled"]["output_token_ids"] != greedy  # the same row without them does sample
    assert "." in rows["nl"]["output"] and rows["nl"]["finish_reason"] == "length"
    for key in ("nl_stop", "csv_style_stop"):
        assert rows[key]["finish_reason"] == "stop" and "." not in rows[key]["output"], rows[key]
        assert rows[key]["stop"] is not None  # the input's stop column comes back as it was


def test_per_row_values_get_the_job_level_checks(run_app, tmp_path):  # noqa: F811
    src = _jsonl(tmp_path, [
        {"id": "p0", "prompt": "x", "top_p": 0}, {"id": "p2", "prompt": "x", "top_p": 1.5},
        {"id": "k", "prompt": "x", "top_k": -1}, {"id": "kf", "prompt": "x", "top_k": 2.5},
        {"id": "s", "prompt": "x", "stop": ""}, {"id": "sl", "prompt": "x", "stop": ["ok", 3]},
        {"id": "good", "prompt": "x", "top_p": 0.9, "top_k": 5, "stop": ["\n"]},
    ])
    path, _ = run_app(f"job.input={src}", "job.max_tokens=2")
    rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    expect = {"p0": "top_p must be in (0, 1]", "p2": "top_p must be in (0, 1]", "k": "top_k must be >= 0",
              "kf": "top_k must be an integer", "s": "stop must be a non-empty string",
              "sl": "stop must be a non-empty string"}
    for key, msg in expect.items():
        assert rows[key]["error_code"] == "invalid_input" and msg in rows[key]["error_message"], rows[key]
    assert rows["good"]["error_code"] is None and (rows["good"]["top_p"], rows["good"]["top_k"]) == (0.9, 5)


def test_unused_columns_are_carried_with_their_types(run_app, tmp_path):  # noqa: F811
    when = dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.timezone.utc)
    table = pa.table({
        "id": pa.array([1, 2], pa.int64()), "prompt": ["hi", "there"],
        "category": pa.array(["a", "b"]).dictionary_encode(),
        "weight": pa.array([1, 2], pa.int8()), "at": pa.array([when, when], pa.timestamp("ms", tz="UTC")),
        "tags": pa.array([["x"], []], pa.list_(pa.string())),
        "output": ["gold 1", "gold 2"],  # clashes with kvbatch's own column
    })
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    path, _ = run_app(f"job.input={src}", "job.max_tokens=2")
    got = pq.read_table(path)
    for name in ("category", "weight", "at", "tags"):
        assert got.schema.field(name).type == table.schema.field(name).type, name
        assert got.column(name).to_pylist() == table.column(name).to_pylist()
    assert got.column("input_output").to_pylist() == ["gold 1", "gold 2"]
    assert got.column("output").to_pylist() != ["gold 1", "gold 2"]
    assert "id" not in got.column_names and got.column("row_key").to_pylist() == ["1", "2"]

    jl = _jsonl(tmp_path, [{"prompt": "a", "category": "x", "level": 1}, {"prompt": "b", "level": "two"}],
                "mixed.jsonl")
    path, _ = run_app(f"job.input={jl}", "job.max_tokens=2")
    rows = pq.read_table(path).to_pylist()
    assert [r["category"] for r in rows] == ["x", None]
    assert [r["level"] for r in rows] == ["1", '"two"']  # mixed types: carried as JSON text
