"""Input readers: JSONL/CSV/Parquet, row keys, per-row overrides, row- vs file-level problems."""
from __future__ import annotations


import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline.config import ConfigError, JobConfig
from kvbatch.pipeline.inputs import read_rows, resolve_input
from tests.pipeline.files import write_jsonl as _jsonl

JOB = JobConfig()



def test_jsonl_keys_overrides_and_order(tmp_path):
    p = _jsonl(tmp_path, [{"id": "a", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "seed": 3},
                          {"prompt": "no id"}, "", {"id": 7, "messages": [{"role": "user", "content": "x"}]}])
    rows = read_rows(p, "auto", JOB)
    assert [r.pos for r in rows] == [0, 1, 2]
    assert rows[0].key == "a" and rows[0].payload == {"prompt": "hi", "max_tokens": 5, "temperature": 0.5, "seed": 3}
    assert len(rows[1].key) == 16 and rows[1].payload == {"prompt": "no id"}
    assert rows[2].key == "7" and rows[2].payload["messages"] == [{"role": "user", "content": "x"}]
    again = read_rows(p, "jsonl", JOB)
    assert [r.key for r in again] == [r.key for r in rows]  # stable across reads


def test_hash_key_depends_on_position_and_content(tmp_path):
    a = read_rows(_jsonl(tmp_path, [{"prompt": "same"}, {"prompt": "same"}]), "auto", JOB)
    assert a[0].key != a[1].key
    b = read_rows(_jsonl(tmp_path, [{"prompt": "same"}, {"prompt": "other"}], "b.jsonl"), "auto", JOB)
    assert b[0].key == a[0].key and b[1].key != a[1].key


@pytest.mark.parametrize("line,needle", [
    ('{"prompt": "x"', "malformed JSON"),
    ('[1, 2]', "not a JSON object"),
    ({"id": 1}, "row has no 'prompt' or 'messages'"),
    ({"prompt": 42}, "prompt must be a string"),
    ({"prompt": ["a"]}, "prompt must be a string"),
    ({"prompt": ""}, "empty prompt"),
    ({"prompt": "   "}, "empty prompt"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens must be >= 1"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens must be an integer"),
    ({"prompt": "x", "temperature": -1}, "temperature must be a finite number >= 0"),
    ({"prompt": "x", "temperature": "hot"}, "temperature must be a number"),
    ({"prompt": "x", "seed": -1}, "seed must be >= 0"),
    ({"prompt": "x", "seed": True}, "seed must be an integer"),
    ({"messages": "not json"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages must be"),
])
def test_bad_rows_carry_an_error(tmp_path, line, needle):
    rows = read_rows(_jsonl(tmp_path, [{"prompt": "fine"}, line]), "auto", JOB)
    assert "error" not in rows[0].payload
    assert needle in rows[1].payload["error"], rows[1].payload


def test_duplicate_ids_are_row_errors(tmp_path):
    rows = read_rows(_jsonl(tmp_path, [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}]), "auto", JOB)
    assert rows[0].key == "x" and "error" not in rows[0].payload
    assert rows[1].key == "x#1" and "duplicate id" in rows[1].payload["error"]


def test_csv(tmp_path):
    p = tmp_path / "in.csv"
    p.write_text('id,prompt,max_tokens,temperature,seed\nr1,"hello, world",8,,\nr2,second,-5,,\nr3,,,,\n')
    rows = read_rows(p, "auto", JOB)
    assert rows[0].payload == {"prompt": "hello, world", "max_tokens": 8}
    assert "max_tokens must be >= 1" in rows[1].payload["error"]
    assert "row has no" in rows[2].payload["error"]


def test_parquet(tmp_path):
    p = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "max_tokens": [4, None, 0],
                             "seed": [None, None, 1]}), p)
    rows = read_rows(p, "auto", JOB)
    assert rows[0].payload == {"prompt": "a", "max_tokens": 4}
    assert "row has no" in rows[1].payload["error"]
    assert "max_tokens must be >= 1" in rows[2].payload["error"]


def test_custom_columns(tmp_path):
    job = JobConfig(prompt_column="question", id_column="qid")
    rows = read_rows(_jsonl(tmp_path, [{"qid": "q1", "question": "why?"}]), "auto", job)
    assert rows[0].key == "q1" and rows[0].payload == {"prompt": "why?"}


@pytest.mark.parametrize("case", ["missing", "suffix", "column", "csv_column", "parquet_garbage"])
def test_file_level_problems_are_config_errors(tmp_path, case):
    if case == "missing":
        path, fmt = tmp_path / "nope.jsonl", "auto"
    elif case == "suffix":
        path, fmt = tmp_path / "in.txt", "auto"
        path.write_text("{}\n")
    elif case == "column":
        path, fmt = _jsonl(tmp_path, [{"text": "x"}]), "auto"
    elif case == "csv_column":
        path, fmt = tmp_path / "in.csv", "auto"
        path.write_text("text\nx\n")
    else:
        path, fmt = tmp_path / "in.parquet", "auto"
        path.write_bytes(b"not parquet")
    with pytest.raises(ConfigError) as info:
        read_rows(path, fmt, JOB)
    assert "\n" not in str(info.value) and str(info.value).startswith("job.")


def test_empty_inputs_have_no_rows(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "e.csv").write_text("prompt\n")
    assert read_rows(tmp_path / "e.jsonl", "auto", JOB) == []
    assert read_rows(tmp_path / "e.csv", "auto", JOB) == []


def test_all_lines_malformed_are_rows_not_a_column_error(tmp_path):
    rows = read_rows(_jsonl(tmp_path, ["{bad", "{worse"]), "auto", JOB)
    assert len(rows) == 2 and all("malformed" in r.payload["error"] for r in rows)


def test_resolve_input_falls_back_to_project_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_input("jobs/sample_prompts.jsonl").is_file()
