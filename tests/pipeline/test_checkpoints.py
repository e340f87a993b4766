"""Long answers survive stops (pipeline/checkpoints.py): a job stopped mid-row by its deadline, a first or
second SIGTERM, continues from the rows' checkpoints and ends with the tokens of a run never stopped.

In process, tiny model, injected stops (debug.deadline_after_tokens; KVBATCH_DEBUG_CRASH_AT's POINT:N:term,
set on pipeline/debug.py here): the same places on any machine, no sleeps. The real kill -9 is in
tests/e2e/test_durable.py.
"""
from __future__ import annotations

import json
import sqlite3

import pyarrow.parquet as pq
import pytest

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline import checkpoints, debug
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.queue import Queue
from kvbatch.pipeline.status import lines
from kvbatch.pipeline.worker import Terminated, Worker

TOKENS = 120
ROWS = [{"id": f"r{i}", "prompt": f"row {i} " * (1 + i)} for i in range(4)]
BASE = ["job.chat_template=false", f"job.max_tokens={TOKENS}", "job.ignore_eos=true", "engine.max_batch=4",
        "worker.prefetch=0", "engine.prefill_chunk=16", "output.progress=off"]
SEEDED = ["sampling.temperature=0.8", "sampling.top_p=0.9", "sampling.repetition_penalty=1.1",
          "sampling.presence_penalty=0.2", "sampling.frequency_penalty=0.1", "sampling.n=2", "sampling.seed=3",
          "sampling.logprobs=1"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("ck") / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


def _cfg(src, out, *more):

    return compose_config(["model=tiny", f"job.input={src}", f"output.dir={out}", *BASE, *more])


def _run(src, out, cache, *more) -> tuple[dict, dict]:
    """One in-process `kvbatch` run: (results by key, summary.json)."""
    path = actions.execute(_cfg(src, out, f"model.cache_dir={cache}", *more))
    rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    return rows, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def refs(src, tmp_path_factory, model_cache_dir):
    """Uninterrupted runs: greedy and seeded."""
    d = tmp_path_factory.mktemp("ck-ref")
    return {"greedy": _run(src, d / "g", model_cache_dir)[0], "seeded": _run(src, d / "s", model_cache_dir, *SEEDED)[0]}


def _same(got: dict, ref: dict) -> None:
    assert list(got) == list(ref)
    for k, r in ref.items():
        assert (got[k]["output_token_ids"], got[k]["finish_reason"]) == (r["output_token_ids"], r["finish_reason"]), k
        if r["output_logprobs"] is not None:
            assert got[k]["output_logprobs"] == pytest.approx(r["output_logprobs"], abs=1e-4)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_deadline_stops_mid_row_keep_every_token_and_the_result_is_unchanged(src, tmp_path, model_cache_dir, refs,
                                                                             kind):
    more = SEEDED if kind == "seeded" else []
    out, generated = tmp_path / "job", 0
    for n in (70, 150, 110)[:3 if kind == "greedy" else 2]:  # stops mid-row for every row in flight
        rows, s = _run(src, out, model_cache_dir, *more, f"debug.deadline_after_tokens={n}")
        run = s["this_run"]
        assert n <= run["generated_tokens"] < n + 8 and run["tokens_lost"] == 0, run
        generated += run["generated_tokens"]
        q = Queue(out / "queue.sqlite")
        kept = checkpoints.in_progress(q)
        assert kept and any(line.startswith(f"in progress: {len(kept)} rows keep") for line in lines(q, 3, 6))
        q.close()
    rows, s = _run(src, out, model_cache_dir, *more)
    _same(rows, refs[kind])
    generated += s["this_run"]["generated_tokens"]
    # nothing generated twice: every output token was made by exactly one run
    assert generated == sum(r["output_tokens"] for r in rows.values())
    assert s["this_run"]["tokens_carried_over"] == sum(r["resumed_tokens"] for r in rows.values()) > 0
    assert all(r["checkpoints"] >= 1 for r in rows.values() if r["resumed_tokens"])


def test_postgresql_queue_keeps_checkpoints_alike(src, tmp_path, model_cache_dir, refs, pg_url):
    url = [f"queue.url='{pg_url}'", "job.name=ck_pg"]
    out = tmp_path / "job"
    _, s = _run(src, out, model_cache_dir, *url, "debug.deadline_after_tokens=100")
    assert s["this_run"]["generated_tokens"] >= 100
    rows, s = _run(src, out, model_cache_dir, *url)
    _same(rows, refs["greedy"])
    assert s["this_run"]["tokens_carried_over"] == sum(r["resumed_tokens"] for r in rows.values()) >= 100 - 8


@pytest.fixture
def term_at(monkeypatch):
    """term_at('decode:N:term', ...): this process sends itself SIGTERM at those crash points."""
    def set_(*specs):
        monkeypatch.setattr(debug, "_specs", debug.parse(",".join(specs)))
        monkeypatch.setattr(debug, "_seen", {})
    return set_


def test_first_sigterm_checkpoints_rows_in_flight_and_exits_143(src, tmp_path, model_cache_dir, refs, term_at):
    out = tmp_path / "job"
    term_at("decode:90:term")
    with pytest.raises(SystemExit) as e:
        actions.execute(_cfg(src, out, f"model.cache_dir={model_cache_dir}"))
    assert e.value.code == 143
    q = Queue(out / "queue.sqlite")
    kept = dict(checkpoints.in_progress(q))
    assert q.counts()["leased"] == 0 and len(kept) == 4 and all(n >= 80 for n in kept.values())
    q.close()
    term_at()
    rows, s = _run(src, out, model_cache_dir)
    _same(rows, refs["greedy"])
    assert {k: r["resumed_tokens"] for k, r in rows.items()} == kept


def test_second_sigterm_exits_at_once_and_keeps_the_periodic_checkpoints(src, tmp_path, model_cache_dir, refs,
                                                                        term_at):
    """Two signals at one step: no stop checkpoint; each row keeps >= its tokens - checkpoint_every.tokens."""
    every = 16
    cfg = _cfg(src, tmp_path / "job", f"model.cache_dir={model_cache_dir}",
               f"worker.checkpoint_every.tokens={every}", "worker.checkpoint_every.seconds=0")
    term_at("decode:75:term", "decode:75:term")
    job = actions.job_for(cfg)
    q, _, _ = actions.enqueue(job)
    w = Worker(cfg, q, job.out_dir / "parts", actions.load_runtime(cfg))
    with pytest.raises(Terminated):
        w.run()
    assert w.eng is not None
    at_stop = {k: len(ck.tokens) for k, ck in w.eng.checkpoints().items()}
    kept = dict(checkpoints.in_progress(q))
    assert q.counts()["leased"] == 0 and set(kept) == set(at_stop)
    for k, n in at_stop.items():  # work kept >= N - tokens since the last checkpoint
        assert n - every < kept[k] <= n, (k, n, kept[k])
    q.close()
    term_at()
    rows, s = _run(src, tmp_path / "job", model_cache_dir, f"worker.checkpoint_every.tokens={every}")
    _same(rows, refs["greedy"])
    assert {k: r["resumed_tokens"] for k, r in rows.items() if r["resumed_tokens"]} == kept


def test_a_corrupt_or_foreign_checkpoint_makes_its_row_start_over(src, tmp_path, model_cache_dir, refs):
    out = tmp_path / "job"
    _run(src, out, model_cache_dir, "debug.deadline_after_tokens=100")
    db = sqlite3.connect(out / "queue.sqlite")
    # r0: its tokens truncated; r1: a valid checkpoint made for another prompt (its checksum holds)
    db.execute("UPDATE checkpoints SET tokens=substr(tokens, 1, 8) WHERE key='r0'")
    fp, n, tokens, state = db.execute("SELECT fingerprint, n, tokens, state FROM checkpoints WHERE key='r1'").fetchone()
    other = "0" * len(fp)
    db.execute("UPDATE checkpoints SET fingerprint=?, checksum=? WHERE key='r1'",
               (other, checkpoints._checksum(other, n, tokens, state)))
    db.commit()
    db.close()
    rows, s = _run(src, out, model_cache_dir)
    _same(rows, refs["greedy"])
    assert rows["r0"]["resumed_tokens"] == rows["r1"]["resumed_tokens"] == 0
    assert rows["r2"]["resumed_tokens"] > 0
    q = Queue(out / "queue.sqlite")
    assert "started over: 2 rows whose checkpoint could not be used (config changed 1, corrupt 1)" in lines(q, 3, 6)
    q.close()


@pytest.mark.parametrize("mode", ["none", "q8"])
def test_a_deadline_keeps_rows_kv_pages_and_the_next_run_loads_them(src, tmp_path, model_cache_dir, mode):
    """worker.keep_kv (default): at the deadline each checkpointed row's full pages go to kv/; the next run
    loads them instead of prefilling its kept tokens, ends with an uninterrupted run's tokens, and removes
    the files once the rows are written. With worker.keep_kv=false: no files, the same tokens."""
    small = ["kv.page_size=16", f"kv.mode={mode}"]
    ref, _ = _run(src, tmp_path / "ref", model_cache_dir, *small)
    out = tmp_path / "job"
    _, s = _run(src, out, model_cache_dir, *small, "debug.deadline_after_tokens=150")
    run = s["this_run"]
    files = list((out / "kv").glob("*.safetensors"))
    assert len(files) == 4 and run["kv_kept_tokens"] >= 4 * 16 and run["kv_kept_tokens"] % 16 == 0, run
    rows, s = _run(src, out, model_cache_dir, *small)
    _same(rows, ref)
    assert s["this_run"]["kv_restored_tokens"] == run["kv_kept_tokens"], s["this_run"]
    assert s["engine"]["kv_files_unused"] == 0 and not list((out / "kv").iterdir())
    # every row prefilled only what followed its kept pages: < one page plus its last token each
    assert s["engine"]["prefill_tokens_total"] <= 4 * 16
    if mode == "none":
        off = tmp_path / "off"
        _run(src, off, model_cache_dir, *small, "debug.deadline_after_tokens=150", "worker.keep_kv=false")
        assert not (off / "kv").exists()
        rows, s = _run(src, off, model_cache_dir, *small, "worker.keep_kv=false")
        _same(rows, ref)
        assert s["this_run"]["kv_restored_tokens"] == 0 and s["engine"]["prefill_tokens_total"] > 4 * 16
