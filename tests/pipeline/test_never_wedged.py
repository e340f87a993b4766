"""Issue 23: hostile rows and files never wedge, crash or mix up a job (in process, tiny model).

Each test names the defect it pins; each failed on the code before the fix.
"""
from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import ConfigError, JobConfig
from kvbatch.pipeline.inputs import read_rows
from kvbatch.pipeline.parts import PartError, read_part, write_part
from kvbatch.pipeline.queue import Queue
from kvbatch.pipeline.results import ResultRecord
from tests.pipeline.files import write_jsonl as _jsonl, error_codes as _codes

JOB = JobConfig()


@pytest.fixture
def run_app(tmp_path, model_cache_dir, capsys):
    """run_app(*overrides) -> (results rows by key, stdout) of one in-process `kvbatch model=tiny ...`."""
    def run(*overrides):
        cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}",
                              "output.progress=off", "job.max_tokens=4", *overrides])
        path = actions.execute(cfg)
        return {r["row_key"]: r for r in pq.read_table(path).to_pylist()}, capsys.readouterr().out
    return run




def test_1_values_that_do_not_fit_the_schema_are_refused_per_row_and_the_job_completes(run_app, tmp_path):
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "big", "prompt": "p", "max_tokens": 1e12},
                            {"id": "seed63", "prompt": "p", "seed": 2**63}, {"id": "b", "prompt": "y"}])
    for _ in range(2):  # the old code failed the part on every run, forever
        rows, _ = run_app(f"job.input={src}")
        assert _codes(rows) == {"a": None, "big": "invalid_input", "seed63": "invalid_input", "b": None}
    assert "max_tokens must be <= 2147483647" in rows["big"]["error_message"]
    assert "seed must be <= 9223372036854775807" in rows["seed63"]["error_message"]


@pytest.mark.parametrize("override,needle", [
    ("job.max_tokens=1000000000000", "job.max_tokens=1000000000000: must be <= 2147483647"),
    ("sampling.seed=9223372036854775808", "sampling.seed=9223372036854775808: must be <= 9223372036854775807"),
    ("sampling.top_k=4294967296", "sampling.top_k=4294967296: must be <="),
    ("sampling.temperature=1e-40", "sampling.temperature=1e-40: must be 0 (greedy) or between"),
])
def test_1_13_config_values_out_of_range_fail_at_once(override, needle, model_cache_dir):
    import re

    with pytest.raises(ConfigError, match=re.escape(needle)):
        compose_config(["model=tiny", override])


def test_record_with_unwritable_values_still_writes_its_part(tmp_path):
    """A give-up or error record carries whatever the payload held (an older queue's, say): the part
    is still written, the bad value dropped and named (defect 1, the record side)."""
    from kvbatch.pipeline.results import fit

    rec = fit(ResultRecord(row_key="k", row_index=0, prompt="p\udc00", max_tokens=10**12, seed=2**64))
    t = read_part(write_part(tmp_path, "part-w-00000.parquet", [rec]))
    row = t.to_pylist()[0]
    assert row["max_tokens"] is None and row["seed"] is None and row["prompt"] == "p\\udc00"
    assert row["error_code"] == "invalid_input" and "max_tokens=1000000000000" in row["error_message"]


def test_2_seed_beyond_64_bits_is_the_rows_error_not_a_crash(run_app, tmp_path):
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "s", "prompt": "p", "seed": 1e20, "temperature": 0.7},
                            {"id": "b", "prompt": "y"}])
    rows, _ = run_app(f"job.input={src}")
    assert _codes(rows) == {"a": None, "s": "invalid_input", "b": None}
    assert rows["a"]["attempt"] == rows["b"]["attempt"] == 1  # batch mates not charged
    again, out = run_app(f"job.input={src}")  # defect 3: nothing stays leased
    assert again == rows and "remaining" not in out


def test_5_deeply_nested_row_is_invalid_input_not_a_failed_job(tmp_path):
    deep = '{"id": "deep", "prompt": "p", "x": ' + "[" * 2000 + "]" * 2000 + "}"
    rows = read_rows(_jsonl(tmp_path, [{"id": "a", "prompt": "x"}, deep, {"id": "b", "prompt": "y"}]), "auto", JOB)
    assert [("error" in r.payload) for r in rows] == [False, True, False]
    assert "nested too deeply" in rows[1].payload["error"]


def test_6_lone_surrogates_are_invalid_input_and_the_queue_takes_them(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "bad \\udc00"}\n'
                   '{"id": "c\\ud800", "prompt": "fine"}\n')
    rows = read_rows(src, "auto", JOB)
    assert [r.key for r in rows] == ["a", "b", "c\\ud800"]
    assert [("Unicode" in r.payload.get("error", "")) for r in rows] == [False, True, True]
    assert rows[1].payload["prompt"] == "bad \\udc00"
    q = Queue(tmp_path / "q.sqlite")
    assert q.enqueue(rows) == 3


def test_7_renamed_duplicates_never_collide_with_a_real_id(run_app, tmp_path):
    src = _jsonl(tmp_path, [{"id": "dup", "prompt": "one"}, {"id": "dup", "prompt": "two"},
                            {"id": "dup#1", "prompt": "three"}, {"id": "dup#1#", "prompt": "four"}])
    keys = [r.key for r in read_rows(src, "auto", JOB)]
    assert len(set(keys)) == 4 and keys[0] == "dup" and keys[2:] == ["dup#1", "dup#1#"]
    rows, _ = run_app(f"job.input={src}")
    assert len(rows) == 4
    assert rows["dup#1"]["prompt"] == "three" and rows["dup#1"]["error_code"] is None
    dup = [r for k, r in rows.items() if k not in ("dup", "dup#1", "dup#1#")][0]
    assert dup["prompt"] == "two" and dup["error_code"] == "invalid_input" and "duplicate id" in dup["error_message"]


def test_10_part_with_a_corrupt_column_name_is_quarantined(tmp_path):
    path = write_part(tmp_path, "part-w-00000.parquet", [ResultRecord(row_key="k", row_index=0)])
    data = bytearray(path.read_bytes())
    at = data.index(b"row_key")  # its name in the footer (the first of two)
    data[at] = 0xFF  # not UTF-8
    path.write_bytes(bytes(data))
    with pytest.raises(PartError):
        read_part(path)


def test_11_csv_field_over_131072_characters_is_read(tmp_path):
    src = tmp_path / "in.csv"
    with open(src, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "prompt"])
        w.writerow(["big", "word " * 200_000])
        w.writerow(["small", "hi"])
    rows = read_rows(src, "auto", JOB)
    assert [r.key for r in rows] == ["big", "small"] and len(rows[0].payload["prompt"]) == 1_000_000


def test_11_huge_csv_prompt_gets_prompt_too_long(run_app, tmp_path):
    src = tmp_path / "in.csv"
    src.write_text("id,prompt\nbig," + "x" * 300_000 + "\nsmall,hi\n")
    rows, _ = run_app(f"job.input={src}", "model.context_length=64")
    assert _codes(rows) == {"big": "prompt_too_long", "small": None}


def test_13_tiny_positive_temperature_is_refused_per_row(tmp_path):
    rows = read_rows(_jsonl(tmp_path, [{"prompt": "x", "temperature": 1e-40}, {"prompt": "x", "temperature": 1e-3},
                                       {"prompt": "x", "temperature": 0}]), "auto", JOB)
    assert "must be 0 (greedy) or between" in rows[0].payload["error"]
    assert rows[1].payload["temperature"] == 1e-3 and rows[2].payload["temperature"] == 0


def test_13_smallest_accepted_temperature_samples_the_greedy_token(run_app, tmp_path):
    """At the floor (1e-3) sampling still works: it picks what greedy picks (no overflow to token 0)."""
    src = _jsonl(tmp_path, [{"id": "g", "prompt": "The cat sat"},
                            {"id": "t", "prompt": "The cat sat", "temperature": 1e-3, "seed": 5}])
    rows, _ = run_app(f"job.input={src}", "job.chat_template=false", "job.max_tokens=8")
    assert rows["t"]["output_token_ids"] == rows["g"]["output_token_ids"]
    assert set(rows["g"]["output_token_ids"]) != {0}


def test_14_nan_values_are_refused_not_replaced_by_the_default(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "t", "prompt": "x", "temperature": NaN}\n{"id": "m", "prompt": "x", "max_tokens": NaN}\n'
                   '{"id": "s", "prompt": "x", "seed": NaN}\n')
    got = {r.key: r.payload.get("error", "") for r in read_rows(src, "auto", JOB)}
    assert "temperature must be a finite number" in got["t"]
    assert "max_tokens must be an integer" in got["m"] and "seed must be an integer" in got["s"]
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["x", "y"], "temperature": [float("nan"), None]}),
                   tmp_path / "in.parquet")
    rows = read_rows(tmp_path / "in.parquet", "auto", JOB)
    assert "temperature must be" in rows[0].payload["error"] and rows[1].payload == {"prompt": "y"}  # null: default


@pytest.mark.parametrize("fmt,text", [
    ("jsonl", '{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n'),
    ("csv", "prompt,id\nx,a\ny,b\n"),
    ("csv", "id,prompt\na,x\nb,y\n"),
])
def test_15_a_byte_order_mark_is_skipped(tmp_path, fmt, text):
    src = tmp_path / f"in.{fmt}"
    src.write_bytes(b"\xef\xbb\xbf" + text.encode())
    rows = read_rows(src, "auto", JOB)
    assert [(r.key, r.payload) for r in rows] == [("a", {"prompt": "x"}), ("b", {"prompt": "y"})]


def test_weak_corrupt_queue_says_how_to_recover(tmp_path):
    from kvbatch.pipeline.queue import QueueUnreadable

    path = tmp_path / "queue.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(QueueUnreadable, match="delete queue.sqlite"):
        Queue(path)


def test_weak_deleting_a_corrupt_queue_recovers_every_finished_row(run_app, tmp_path, monkeypatch, model_cache_dir):
    import subprocess
    import sys

    from kvbatch.pipeline.queue import QueueUnreadable

    src = _jsonl(tmp_path, [{"id": str(i), "prompt": f"row {i}"} for i in range(3)])
    p = subprocess.run([sys.executable, "-m", "kvbatch", "model=tiny", f"model.cache_dir={model_cache_dir}",
                        f"job.input={src}", f"output.dir={tmp_path / 'o'}", "job.max_tokens=4", "output.progress=off"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = {r["row_key"]: r for r in pq.read_table(tmp_path / "o" / "results.parquet").to_pylist()}
    (tmp_path / "o" / "queue.sqlite").write_bytes(b"garbage" * 1000)
    for f in ("queue.sqlite-wal", "queue.sqlite-shm"):
        (tmp_path / "o" / f).unlink(missing_ok=True)
    with pytest.raises(QueueUnreadable):
        run_app(f"job.input={src}", "output.dir=" + str(tmp_path / "o"))
    (tmp_path / "o" / "queue.sqlite").unlink()
    monkeypatch.setattr(actions, "load_runtime", lambda cfg: pytest.fail("rows in parts were generated again"))
    again, _ = run_app(f"job.input={src}", "output.dir=" + str(tmp_path / "o"))
    assert {k: r["output_token_ids"] for k, r in again.items()} == {k: r["output_token_ids"] for k, r in rows.items()}


def test_weak_unusable_inputs_and_output_folders_are_one_line_errors(tmp_path, model_cache_dir):
    import os

    loop = tmp_path / "loop.jsonl"
    os.symlink(tmp_path / "loop2.jsonl", loop)
    os.symlink(loop, tmp_path / "loop2.jsonl")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    good = _jsonl(tmp_path, [{"prompt": "x"}])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [(f"job.input={loop}", "job.input="), (f"job.input={fifo}", "not a regular file"),
             (f"output.dir={blocker / 'sub'}", "is not writable")]
    for override, needle in cases:
        cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={good}",
                              f"output.root={tmp_path / 'out'}", override])
        with pytest.raises(ConfigError, match=needle):
            actions.execute(cfg)


def test_8_a_larger_memory_budget_regenerates_rows_refused_for_memory(run_app, tmp_path, monkeypatch):
    src = _jsonl(tmp_path, [{"id": "s", "prompt": "hi"}, {"id": "b", "prompt": "hi", "max_tokens": 400}])
    out = f"output.dir={tmp_path / 'o'}"
    small, _ = run_app(f"job.input={src}", out, "memory.budget=3MiB")  # room for the short row only
    assert _codes(small) == {"s": None, "b": "insufficient_memory"}
    rows, out_text = run_app(f"job.input={src}", out, "memory.budget=8GiB")
    assert _codes(rows) == {"s": None, "b": None} and rows["b"]["output_tokens"] > 4 and rows["b"]["attempt"] == 1
    assert rows["s"] == small["s"]  # a finished row keeps its result
    monkeypatch.setattr(actions, "load_runtime", lambda cfg: pytest.fail("generated again with the same budget"))
    again, _ = run_app(f"job.input={src}", out, "memory.budget=8GiB")
    assert again == rows


def test_weak_a_budget_with_no_room_for_one_row_is_refused_at_start(run_app, tmp_path):
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}])
    with pytest.raises(ConfigError, match=r"memory.budget='1B': the budget \(1B\) leaves no room for even one row"):
        run_app(f"job.input={src}", "memory.budget=1B")


def test_9_reusing_an_output_dir_with_another_config_is_refused(run_app, tmp_path):
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}])
    out = f"output.dir={tmp_path / 'o'}"
    first, _ = run_app(f"job.input={src}", out, "kv=none")
    with pytest.raises(ConfigError, match="holds the rows of another config"):
        run_app(f"job.input={src}", out, "kv=q8", "job.max_tokens=32")
    with pytest.raises(ConfigError, match="holds the rows of another config"):
        run_app(f"job.input={src}", out, "sampling.seed=3", "action=finalize")
    meta = pq.read_table(tmp_path / "o" / "results.parquet").schema.metadata
    assert json.loads(meta[b"kvbatch.config"])["kv"]["mode"] == "none"  # still names the config that made it
    again, _ = run_app(f"job.input={src}", out, "kv=none")
    assert again == first


def test_22_4_an_edited_row_is_generated_again_and_its_old_output_dropped(run_app, tmp_path):
    args = ("job.chat_template=false", f"output.dir={tmp_path / 'o'}")
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "The cat"}, {"id": "b", "prompt": "A dog"}])
    before, _ = run_app(f"job.input={src}", *args)
    _jsonl(tmp_path, [{"id": "a", "prompt": "The cat"}, {"id": "b", "prompt": "A bird flew"}])
    after, _ = run_app(f"job.input={src}", *args)
    fresh_src = _jsonl(tmp_path, [{"id": "b", "prompt": "A bird flew"}], "fresh.jsonl")
    fresh, _ = run_app(f"job.input={fresh_src}", "job.chat_template=false", f"output.dir={tmp_path / 'f'}")
    assert after["a"] == before["a"]  # unchanged: not generated again
    assert after["b"]["prompt"] == "A bird flew" and after["b"]["output_token_ids"] == fresh["b"]["output_token_ids"]
    assert after["b"]["attempt"] == 1
    table = pq.read_table(tmp_path / "o" / "results.parquet")
    assert "A dog" not in table.column("prompt").to_pylist() and table.num_rows == 2
    q = Queue(tmp_path / "o" / "queue.sqlite")
    assert [r[5] for r in q.attempts("b")] == ["input_changed", "done"]


def test_22_4_a_result_written_by_the_worker_holding_an_edited_row_is_never_taken(tmp_path):
    """The edit lands while a worker holds the row: what that worker writes (acknowledged or adopted)
    belongs to the old content and is skipped; the row is generated again."""
    from kvbatch.pipeline.finalize import finalize, regenerate
    from kvbatch.pipeline.inputs import InputRow

    q = Queue(tmp_path / "queue.sqlite")
    q.enqueue([InputRow(0, "k", {"prompt": "old"})])
    q.claim("w1", 1, lease_s=600)
    q.enqueue([InputRow(0, "k", {"prompt": "new"})])
    regenerate(tmp_path, q, ["k"], "input_changed")
    write_part(tmp_path / "parts", "part-w1-00000.parquet",
               [ResultRecord(row_key="k", row_index=0, prompt="old", worker="w1", finish_reason="stop")])
    q.ack("w1", [("k", None)], "part-w1-00000.parquet")
    fin = finalize(tmp_path, q, {})
    assert fin.rows == 0 and fin.adopted == 0 and q.counts()["pending"] == 1
    got = q.claim("w2", 1, lease_s=600)
    assert got[0].payload == {"prompt": "new"} and got[0].attempt == 1
