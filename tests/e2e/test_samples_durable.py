"""n samples survive kill -9 (issue 21): each (row, sample) is its own queue row, written and acknowledged
on its own, so a worker killed mid-job and run again gives every (row, sample) exactly once, with the
tokens of an uninterrupted run (each sample's seed is derived from its key, not from who ran it)."""
from __future__ import annotations

import json

import pyarrow.parquet as pq

from kvbatch.pipeline.queue import Queue
from tests.e2e.test_durable import check_files, kill_9_at, kvbatch

ROWS = [{"id": f"p{i}", "prompt": f"sample {i} " * (2 + i % 3), "max_tokens": [24, 120, 60][i % 3]} for i in range(5)]
ROWS[2]["n"] = 1  # its own n
KEYS = [k for i in range(5) for k in (["p2"] if i == 2 else [f"p{i}#s{j}" for j in range(3)])]
SETTINGS = ["sampling.n=3", "sampling.temperature=0.8", "engine.max_batch=4", "engine.prefill_chunk=8",
            "worker.prefetch=2", "worker.flush_rows=2", "worker.flush_s=1000", "output.progress=off"]


def test_kill_9_mid_job_with_samples_then_every_row_and_sample_once(tmp_path, model_cache_dir):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", "job.chat_template=false",
            *SETTINGS]
    p = kvbatch(tmp_path / "ref", args)
    assert p.returncode == 0, p.stderr
    ref = {r["row_key"]: r for r in pq.read_table(tmp_path / "ref" / "results.parquet").to_pylist()}
    assert list(ref) == KEYS and all(r["error_code"] is None for r in ref.values())
    assert len({tuple(r["output_token_ids"]) for r in ref.values()}) == len(KEYS)  # samples differ

    out = tmp_path / "out"
    for i, crash in enumerate(["decode:40:pause", "after_part_write:1:pause", "after_ack:1:pause"]):
        kill_9_at(out, args, crash, tmp_path / f"kill{i}.err")
        check_files(out)
    final = kvbatch(out, args)
    assert final.returncode == 0, final.stderr
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["row_key"] for r in rows] == KEYS
    assert [(r["row_index"], r["sample_index"]) for r in rows] == [(ref[k]["row_index"], ref[k]["sample_index"])
                                                                   for k in KEYS]
    for r in rows:
        assert (r["output_token_ids"], r["seed"]) == (ref[r["row_key"]]["output_token_ids"], ref[r["row_key"]]["seed"])
    q = Queue(out / "queue.sqlite")
    # exactly one acknowledged attempt per (row, sample); the others ended with their worker
    assert sorted(a[0] for a in q.attempts() if a[5] in ("done", "error")) == sorted(KEYS)
    assert [s["stop"] for s in q.sessions()] == ["died"] * 3 + ["finished"]
