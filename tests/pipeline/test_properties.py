"""Property-based tests (Hypothesis), issue 23: hostile rows for the readers and the queue.

Whatever a row holds (any JSON value in any column, NaN and infinities, huge or negative numbers,
lone surrogates, deep nesting, duplicate and colliding ids, broken lines, a byte-order mark), the
readers give every row exactly one unique key and a payload the queue can store, and a whole run
writes every input row to results.parquet exactly once, in input order, with no code or one of
the documented codes.
"""
from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvbatch.pipeline.actions as actions
from kvbatch.engine import params
from kvbatch.engine.errors import ERROR_CODES, INVALID_INPUT
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import JobConfig
from kvbatch.pipeline.inputs import read_rows
from kvbatch.pipeline.queue import Queue

JOB = JobConfig()
SURROGATES = st.sampled_from(["\ud800", "\udc00", "a\udfffb"])
TEXT = st.one_of(st.text(max_size=12), SURROGATES, st.sampled_from(["", "   ", "dup", "dup#1", "dup#2", "x#"]))
NUMBER = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0, 1, 2**31, 2**63, 2**64, 1e12, 1e20, 1e-40, 0.5, -1]))
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
VALUE = st.recursive(SCALAR, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(TEXT, c, max_size=3)),
                     max_leaves=6)
ID = st.one_of(st.none(), st.sampled_from(["dup", "dup#1", "dup#2", "a", "a#0"]), st.integers(-3, 3), TEXT)
MESSAGES = st.one_of(VALUE, st.lists(st.fixed_dictionaries({"role": TEXT, "content": TEXT}), max_size=2))
ROW = st.fixed_dictionaries({}, optional={"id": ID, "prompt": st.one_of(TEXT, VALUE), "messages": MESSAGES,
                                          "max_tokens": st.one_of(NUMBER, TEXT), "temperature": st.one_of(NUMBER, TEXT),
                                          "seed": st.one_of(NUMBER, TEXT), "extra": VALUE})
BROKEN = st.sampled_from(['{"prompt": ', "[1, 2]", "null", '"just a string"', "{" * 3000 + "}" * 3000,
                          '{"id": "deep", "prompt": "p", "x": ' + "[" * 3000 + "]" * 3000 + "}"])
LINE = st.one_of(ROW.map(lambda r: json.dumps(r, allow_nan=True)), BROKEN)


def _write(path, lines, bom):
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + "".join(line + "\n" for line in lines).encode())


def _valid(payload: dict) -> bool:
    """A payload without an error is one the engine can run: a prompt, values in range."""
    if not isinstance(payload.get("prompt"), str):
        return False
    mt, t, s = payload.get("max_tokens"), payload.get("temperature"), payload.get("seed")
    return (mt is None or (isinstance(mt, int) and not params.max_tokens_error(mt))) and \
        (s is None or (isinstance(s, int) and not params.seed_error(s))) and \
        (t is None or (isinstance(t, float) and math.isfinite(t) and not params.temperature_error(t)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(lines=st.lists(LINE, max_size=8), bom=st.booleans())
def test_every_hostile_line_becomes_one_storable_row_with_a_unique_key(tmp_path_factory, lines, bom):
    d = tmp_path_factory.mktemp("prop")
    src = d / "in.jsonl"
    _write(src, lines, bom)
    try:
        rows = read_rows(src, "auto", JOB)
    except Exception as exc:  # only the documented file-level refusal: no prompt/messages column at all
        assert "no such column" in str(exc), exc
        return
    assert len(rows) == len(lines) and [r.pos for r in rows] == list(range(len(lines)))
    assert len({r.key for r in rows}) == len(rows)
    for r in rows:
        json.dumps(r.payload, ensure_ascii=False).encode("utf-8")  # what the queue stores
        r.key.encode("utf-8")
        assert "error" in r.payload or _valid(r.payload), r.payload
    q = Queue(d / "queue.sqlite")
    assert q.enqueue(rows) == len(rows) and q.counts()["pending"] == len(rows)
    assert q.enqueue(rows) == 0 and q.changed(rows) == []  # reading the same file again changes nothing
    q.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(lines=st.lists(LINE, min_size=1, max_size=6), bom=st.booleans())
def test_a_run_writes_every_hostile_row_exactly_once_with_a_documented_code(tmp_path_factory, model_cache_dir,
                                                                           lines, bom):
    d = tmp_path_factory.mktemp("prop-run")
    src = d / "in.jsonl"
    _write(src, lines + [json.dumps({"prompt": "a good row"})], bom)  # one good row: the job succeeds
    cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}",
                          f"output.dir={d / 'out'}", "output.progress=off", "job.max_tokens=3",
                          "output.max_error_fraction=1", "model.context_length=256"])
    path = actions.execute(cfg)
    got = pq.read_table(path).to_pylist()
    want = [r.key for r in read_rows(src, "auto", JOB)]
    assert [r["row_key"] for r in got] == want and [r["row_index"] for r in got] == list(range(len(want)))
    for r in got:
        assert r["error_code"] is None or r["error_code"] in ERROR_CODES, r
        assert (r["error_code"] is None) == (r["finish_reason"] in ("stop", "length")), r
    assert got[-1]["error_code"] is None
    q = Queue(d / "out" / "queue.sqlite")
    assert q.counts()["pending"] == q.counts()["leased"] == 0
    invalid = {r.key for r in read_rows(src, "auto", JOB) if "error" in r.payload}
    assert {r["row_key"] for r in got if r["error_code"] == INVALID_INPUT} >= invalid
    q.close()


CELL = st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["NaN", "inf", "-1", "1e20", "1e12", "2.5", "0",
                                                                  "dup", "dup#1", "\ufeff", '"', ",", "\n"]),
                 st.integers(-(2**65), 2**65).map(str))
TABLE_ROW = st.fixed_dictionaries({"id": CELL, "prompt": CELL, "max_tokens": CELL, "temperature": CELL, "seed": CELL})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(TABLE_ROW, min_size=1, max_size=8), fmt=st.sampled_from(["csv", "parquet"]), bom=st.booleans())
def test_every_hostile_csv_or_parquet_row_becomes_one_storable_row(tmp_path_factory, rows, fmt, bom):
    import csv
    import io

    import pyarrow as pa

    d = tmp_path_factory.mktemp("prop-table")
    src = d / f"in.{fmt}"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows([{k: ("" if v is None else v) for k, v in r.items()} for r in rows])
        src.write_bytes((b"\xef\xbb\xbf" if bom else b"") + buf.getvalue().encode("utf-8"))
        n = sum(1 for _ in csv.DictReader(io.StringIO(buf.getvalue())))  # rows as csv reads them back
    else:
        pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([(k, pa.string()) for k in rows[0]])), src)
        n = len(rows)
    got = read_rows(src, "auto", JOB)
    assert len(got) == n and len({r.key for r in got}) == n
    for r in got:
        json.dumps(r.payload, ensure_ascii=False).encode("utf-8")
        assert "error" in r.payload or _valid(r.payload), r.payload
    q = Queue(d / "queue.sqlite")
    assert q.enqueue(got) == n
    q.close()
