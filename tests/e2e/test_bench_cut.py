"""The whole-job benchmarks' kvbatch side cut at its time limit (benchmarks/job/job_vs_mlx_lm.py `run_kvbatch`): the
command gets SIGTERM, stops at its next step, and the cut side still reports what it did until then (rows,
tokens, the engine's figures), from the queue's record of the worker session: a GPU call's side that runs past its
limit leaves figures, not only "timed out"."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks.job.job_vs_mlx_lm import Cut, run_kvbatch


def test_a_side_cut_at_its_limit_reports_what_it_did(tmp_path, monkeypatch, model_cache_dir):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"Tell a long story about river {i}."}) + "\n" for i in range(3)))
    # the run pauses after its third decode step until a signal comes: the limit always finds it there
    monkeypatch.setenv("KVBATCH_DEBUG_CRASH_AT", "decode:3:pause")
    with pytest.raises(Cut) as cut:
        run_kvbatch([sys.executable, "-m", "kvbatch"], inp, tmp_path / "out", "tiny",
                    {"name": "tiny", "cache_dir": str(model_cache_dir)}, 200, [], timeout=40, grace=60)
    p = cut.value.partial
    assert p["cut_rows"] == 0 and p["cut_tokens"] >= 3 * 3  # three steps of three rows, none finished
    assert p["wall_s"] >= 40 and p["cut_tok_s"] == p["cut_tokens"] / p["wall_s"]
    eng = p["engine"]
    assert eng["decode_s"] > 0 and eng["prefill_s"] > 0 and eng["peak_concurrency"] == 3
