"""Per-row sampling parameters and carried-through columns (issue 22.2): every sampling parameter a job
accepts is accepted per row, with the same checks; input columns kvbatch does not use come back in
results.parquet unchanged."""
from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.parquet as pq

from tests.pipeline.test_pipeline import run_app  # noqa: F401  (fixture)
from tests.pipeline.files import write_jsonl as _jsonl



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


# A valid value and an out-of-range one of each kind, as a CSV cell holds them (text).
_GOOD = {"int": ("3", 3), "float": ("0.5", 0.5), "bool": ("yes", True), "ids": ("[1, 2]", [1, 2]),
         "strings": ('["a"]', ["a"]), "format": ("json_object", "json_object"), "name": ("math-v2", "math-v2")}
_BAD = {"int": "-1", "float": "inf", "bool": "maybe", "ids": "[-1]", "strings": '[""]', "format": "nonsense",
        "name": "two words"}


def test_the_table_is_carried_by_the_config_schema_results_schema_and_input_reader():
    """engine/params.py's PARAMS is the one list of per-row parameters: every entry has its config key (with
    the table's default), its results column (or says where results show it), and the input reader reads
    and range-checks it; nothing else names a per-row parameter the table lacks."""
    from dataclasses import fields

    from kvbatch.engine.params import PARAMS, SamplingParams
    from kvbatch.engine.models.config import ModelConfig
    from kvbatch.pipeline import api, model_defaults, passthrough
    from kvbatch.pipeline.config import JobConfig, SamplingConfig
    from kvbatch.pipeline.formats import openai_batch
    from kvbatch.pipeline.inputs import row_payload
    from kvbatch.pipeline.results import ARROW, SCHEMA

    names = [p.name for p in PARAMS]
    assert len(set(names)) == len(names) and {"temperature", "stop", "n", "response_format"} <= set(names)
    # the config schema: sampling holds exactly the table's sampling entries, job holds its job entries
    sections = {"sampling": SamplingConfig(), "job": JobConfig()}
    # (and sampling.defaults: where the unset ones come from)
    assert {f.name for f in fields(SamplingConfig)} - {"defaults"} == {p.name for p in PARAMS
                                                                       if p.section == "sampling"}
    for p in PARAMS:
        value = getattr(sections[p.section], p.name)
        if value is None and p.name in model_defaults.KEYS:  # unset: the model's default, else the table's
            model_defaults.fill(sections["sampling"], ModelConfig())
            value = getattr(sections[p.section], p.name)
        assert (tuple(value) if isinstance(value, list) else value) == p.default, p.name
        assert api._key(p.name) == f"{p.section}.{p.name}"
    # the engine's parameters: every SamplingParams field but those made from other settings (the grammar from
    # response_format, the reasoning tags and their limit from job.reasoning and job.max_reasoning_tokens)
    made = {"grammar", "reasoning", "max_reasoning_tokens"}
    assert {f.name for f in fields(SamplingParams)} - made == {p.name for p in PARAMS if p.engine}
    # the results schema: a column of the table's type, else shown otherwise
    shown_otherwise = {"n": "sample_index", "prompt_logprobs": "prompt_logprobs"}
    for p in PARAMS:
        if p.column is not None:
            assert SCHEMA.field(p.name).type == ARROW[p.column], p.name
        elif p.carried:
            assert p.name not in passthrough.ROW_PARAMS  # the input's column comes back as it was
        else:
            assert shown_otherwise[p.name] in SCHEMA.names, p.name
    param_columns = [n for n in SCHEMA.names if n in names and n not in shown_otherwise.values()]
    assert param_columns == [p.name for p in PARAMS if p.column is not None]  # in the table's order
    assert set(openai_batch.SAME) <= set(names)
    # the input reader: every entry read from text (CSV) and range-checked, with the one range check
    job = JobConfig()
    for p in PARAMS:
        text, value = _GOOD[p.kind]
        assert row_payload({"prompt": "x", p.name: text}, job)[p.name] == value, p.name
        assert row_payload({"prompt": "x", p.name: None}, job) == {"prompt": "x"}  # null: the job's value
        error = row_payload({"prompt": "x", p.name: _BAD[p.kind]}, job).get("error", "")
        assert error.startswith(p.name) or p.kind == "format", (p.name, error)
        assert "error" in row_payload({"prompt": "x", p.name: _BAD[p.kind]}, job), p.name


def test_engine_and_pipeline_share_one_range_check():
    """A value the input reader or the config refuses, the engine refuses too (and the other way round)."""
    from kvbatch.engine.params import SamplingParams
    from kvbatch.pipeline.inputs import row_payload
    from kvbatch.pipeline.config import JobConfig

    for name, bad in (("temperature", 1e-5), ("temperature", 2000.0), ("top_p", 0.0), ("top_k", -1),
                      ("seed", 2**63), ("max_tokens", 2**31), ("min_p", 1.5), ("repetition_penalty", 0.0),
                      ("presence_penalty", 3.0), ("logprobs", 21), ("stop", ("",)), ("stop_token_ids", (-1,))):
        engine = SamplingParams(**{name: bad}).problem()
        reader = row_payload({"prompt": "x", name: list(bad) if isinstance(bad, tuple) else bad}, JobConfig())
        assert engine is not None and engine.startswith(name) and reader["error"].startswith(name), (name, engine)
    assert SamplingParams(temperature=1e-3, top_k=5, seed=2**63 - 1).problem() is None
    assert SamplingParams(max_tokens=4, min_tokens=5).problem() == "min_tokens must be in [0, max_tokens=4], got 5"
