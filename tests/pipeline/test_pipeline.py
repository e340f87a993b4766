"""End to end, in process, on the tiny model: results schema, resume, bad rows, long prompts, empty input."""
from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.queue import Queue
from kvbatch.pipeline.results import SCHEMA

SAMPLE_IDS = ["capital", "haiku", "math", "explain", "list", "code", "chat", "story"]


@pytest.fixture
def run_app(tmp_path, model_cache_dir, capsys):
    """run_app(*overrides) -> (results path, stdout) of one in-process `kvbatch model=tiny ...`."""
    def run(*overrides):
        cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}",
                              f"output.root={tmp_path / 'out'}", "output.progress=off", *overrides])
        path = actions.execute(cfg)
        return path, capsys.readouterr().out
    return run


def _write(tmp_path, lines, name="in.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_main_job_end_to_end_and_rerun_generates_nothing(run_app, monkeypatch):
    t0 = time.perf_counter()
    path, out = run_app()
    assert time.perf_counter() - t0 < 60
    assert out.strip().splitlines()[-1] == str(path)
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == SCHEMA
    assert table.schema.field("output_token_ids").type == pa.list_(pa.int32())
    rows = table.to_pylist()
    assert [r["row_key"] for r in rows] == SAMPLE_IDS and [r["row_index"] for r in rows] == list(range(8))
    for r in rows:
        assert r["error_code"] is None and r["finish_reason"] in ("stop", "length")
        assert r["output_tokens"] == len(r["output_token_ids"]) > 0 and r["prompt_tokens"] > 0
        assert r["model"] == "tiny" and r["kv_mode"] == "none" and r["wall_s"] > 0
    by = {r["row_key"]: r for r in rows}
    assert by["math"]["max_tokens"] == 16 and by["haiku"]["temperature"] == 0.7 and by["haiku"]["seed"] == 7
    assert by["capital"]["max_tokens"] == 128
    meta = table.schema.metadata
    assert json.loads(meta[b"kvbatch.config"])["model"]["source"] == "tiny"
    assert {b"kvbatch.version", b"mlx.version", b"mlx-lm.version"} <= set(meta)
    summary = json.loads((path.parent / "summary.json").read_text())
    assert summary["rows"] == summary["rows_ok"] == 8 and summary["route"] and summary["blas"]
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in rows)
    assert summary["this_run"]["tokens_per_s"] > 0 and summary["peak_memory_bytes"] > 0
    assert path.parent.parent.name == "sample"

    parts_before = sorted(p.name for p in (path.parent / "parts").iterdir())
    monkeypatch.setattr(actions, "load_runtime", lambda cfg: pytest.fail("model loaded on a finished job"))
    path2, out2 = run_app()
    assert path2 == path and out2.strip().splitlines()[-1] == str(path)
    assert "nothing generated this run" in out2
    assert sorted(p.name for p in (path.parent / "parts").iterdir()) == parts_before
    assert pq.read_table(path2).column("output").to_pylist() == table.column("output").to_pylist()
    assert len(Queue(path.parent / "queue.sqlite").attempts()) == 8


def test_summary_and_results_record_the_engine_options(run_app, tmp_path):
    from dataclasses import asdict

    from kvbatch.engine.config import EngineOptions

    src = _write(tmp_path, [{"id": "a", "prompt": "The cat"}])
    path, _ = run_app(f"job.input={src}", "job.max_tokens=3", "engine.options.lookahead=off")
    want = {**asdict(EngineOptions()), "lookahead": "off"}
    assert json.loads((path.parent / "summary.json").read_text())["options"] == want
    assert json.loads(pq.read_table(path).schema.metadata[b"kvbatch.config"])["engine"]["options"] == want


def test_bad_rows_get_invalid_input_and_the_rest_completes(run_app, tmp_path):
    src = _write(tmp_path, [
        {"id": "ok1", "prompt": "hello"},
        '{"id": "broken", "prompt": ',
        {"id": "noprompt", "text": "x"},
        {"id": "number", "prompt": 12},
        {"id": "empty", "prompt": ""},
        {"id": "neg", "prompt": "hi", "max_tokens": -5},
        {"id": "ok2", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 4},
    ])
    path, _ = run_app(f"job.input={src}", "job.max_tokens=6")
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 7 and rows[1]["row_key"] != "broken"  # a malformed line has a hashed key
    bad = rows[1:6]
    for r in bad:
        assert r["error_code"] == "invalid_input" and r["finish_reason"] == "error" and r["error_message"]
        assert r["output_tokens"] == 0 and r["prompt_tokens"] is None  # never reached the engine
    assert [r["error_message"] for r in bad][1:] == [
        "row has no 'prompt' or 'messages'", "prompt must be a string, got int", "empty prompt",
        "max_tokens must be >= 1, got -5"]
    assert "malformed JSON" in bad[0]["error_message"]
    assert [(r["row_key"], r["error_code"], r["output_tokens"]) for r in (rows[0], rows[6])] == [
        ("ok1", None, 6), ("ok2", None, 4)]


def test_prompt_longer_than_context_is_prompt_too_long(run_app, tmp_path):
    src = _write(tmp_path, [{"id": "long", "prompt": "word " * 40}, {"id": "short", "prompt": "hi"}])
    path, _ = run_app(f"job.input={src}", "model.context_length=64", "job.max_tokens=4")
    rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    assert rows["long"]["error_code"] == "prompt_too_long" and rows["long"]["finish_reason"] == "error"
    assert rows["short"]["error_code"] is None and rows["short"]["output_tokens"] == 4


def test_empty_input_gives_an_empty_results_file(run_app, tmp_path):
    src = _write(tmp_path, [""])
    path, out = run_app(f"job.input={src}")
    assert "has no rows" in out
    t = pq.read_table(path)
    assert t.num_rows == 0 and t.schema.remove_metadata() == SCHEMA


def test_raw_prompts_and_greedy_matches_the_engine(run_app, tmp_path, tiny_model):
    from kvbatch.engine import Engine, Request, SamplingParams
    from kvbatch.engine.testing import engine_config

    src = _write(tmp_path, [{"id": "a", "prompt": "The cat"}, {"id": "b", "prompt": "A dog"}])
    path, _ = run_app(f"job.input={src}", "job.chat_template=false", "job.max_tokens=8")
    got = {r["row_key"]: r["output_token_ids"] for r in pq.read_table(path).to_pylist()}
    model, tok, spec = tiny_model()
    ref = Engine(model, tok, spec, engine_config()).generate(
        [Request(key="a", prompt_tokens=tok.encode("The cat"), sampling=SamplingParams(max_tokens=8))])
    assert got["a"] == ref[0].tokens


def test_nonfinite_row_ends_with_its_code(run_app, tmp_path):
    src = _write(tmp_path, [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}])
    path, _ = run_app(f"job.input={src}", "debug.inject_nonfinite=b:2", "job.max_tokens=6")
    rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    assert rows["b"]["error_code"] == "non_finite_logits" and rows["b"]["finish_reason"] == "error"
    assert rows["a"]["error_code"] is None and rows["a"]["output_tokens"] == 6


def test_deadline_leaves_rows_queued_and_the_next_run_finishes(run_app, tmp_path):
    src = _write(tmp_path, [{"id": str(i), "prompt": f"row {i}"} for i in range(3)])
    path, out = run_app(f"job.input={src}", "worker.deadline=0s", "job.max_tokens=4")
    assert pq.read_table(path).num_rows == 0 and "3 remaining" in out
    path, out = run_app(f"job.input={src}", "job.max_tokens=4")
    assert pq.read_table(path).column("row_key").to_pylist() == ["0", "1", "2"]


def test_unacknowledged_rows_are_adopted_and_lost_parts_rerun(run_app, tmp_path, monkeypatch):
    src = _write(tmp_path, [{"id": str(i), "prompt": f"row {i}"} for i in range(4)])
    args = (f"job.input={src}", "job.max_tokens=5", "worker.flush_rows=2")
    path, _ = run_app(*args)
    first = pq.read_table(path).to_pylist()
    q = Queue(path.parent / "queue.sqlite")
    # A worker died after its part was renamed but before the ack: the rows look unfinished.
    q.db.execute("UPDATE rows SET state='pending', part=NULL WHERE key IN ('0', '1')")
    real_load = actions.load_runtime
    monkeypatch.setattr(actions, "load_runtime", lambda cfg: pytest.fail("adopted rows were generated again"))
    path, _ = run_app(*args)
    assert pq.read_table(path).to_pylist() == first
    # A part got corrupted: its rows are generated again, never dropped.
    part = q.manifest()[2][3]
    (path.parent / "parts" / part).write_bytes(b"garbage")
    monkeypatch.setattr(actions, "load_runtime", real_load)
    path, _ = run_app(*args)
    again = pq.read_table(path).to_pylist()
    assert [r["row_key"] for r in again] == ["0", "1", "2", "3"]
    assert [r["output_token_ids"] for r in again] == [r["output_token_ids"] for r in first]
    assert (path.parent / "parts" / "corrupt" / part).exists()
    assert [r[5] for r in q.attempts("2")] == ["lost_part", "done"]
