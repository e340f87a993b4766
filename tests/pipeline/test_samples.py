"""n samples per row and seeds that differ by default (issue 21), through the whole pipeline in process."""
from __future__ import annotations

import json

import pyarrow.parquet as pq

from kvbatch.engine.samples import derive_seed
from kvbatch.pipeline.inputs import InputRow
from kvbatch.pipeline.samples import SAMPLE_SLOTS, expand, seed_for
from tests.pipeline.test_pipeline import run_app  # noqa: F401  (fixture)
from tests.pipeline.files import write_jsonl as _jsonl



def test_n_samples_one_results_row_each_and_seeds_that_differ(run_app, tmp_path):  # noqa: F811
    src = _jsonl(tmp_path, [
        {"id": "a", "prompt": "Once upon a time", "topic": "story"},
        {"id": "dup1", "prompt": "The cat sat on"},
        {"id": "dup2", "prompt": "The cat sat on"},  # a duplicated prompt, no seed: its own derived seed
        {"id": "one", "prompt": "Hello there", "n": 1},  # its own n
        {"id": "own", "prompt": "Hello there", "seed": 11, "n": 2},  # its own seed, kept by sample 0
        {"id": "bad", "prompt": ""},
    ])
    args = (f"job.input={src}", "job.max_tokens=12", "job.chat_template=false", "sampling.temperature=1.0",
            "sampling.n=3", "sampling.seed=5")
    path, _ = run_app(*args)
    rows = pq.read_table(path).to_pylist()
    keys = [(r["row_key"], r["row_index"], r["sample_index"]) for r in rows]
    assert keys == [("a#s0", 0, 0), ("a#s1", 0, 1), ("a#s2", 0, 2), ("dup1#s0", 1, 0), ("dup1#s1", 1, 1),
                    ("dup1#s2", 1, 2), ("dup2#s0", 2, 0), ("dup2#s1", 2, 1), ("dup2#s2", 2, 2), ("one", 3, 0),
                    ("own#s0", 4, 0), ("own#s1", 4, 1), ("bad", 5, 0)]
    by = {r["row_key"]: r for r in rows}
    assert by["bad"]["error_code"] == "invalid_input" and all(r["error_code"] is None for r in rows[:-1])
    assert by["own#s0"]["seed"] == 11 and by["own#s1"]["seed"] == derive_seed(11, "own#s1")
    assert by["a#s1"]["seed"] == derive_seed(5, "a#s1") and by["one"]["seed"] == derive_seed(5, "one")
    assert len({r["seed"] for r in rows[:-1]}) == 12
    assert len({tuple(r["output_token_ids"]) for r in rows[:9]}) == 9  # samples and duplicates differ
    assert [r["topic"] for r in rows[:3]] == ["story"] * 3  # each sample carries its row's columns
    # a sample forked from its first: its prompt taken from shared pages, not computed
    assert [by[f"a#s{i}"]["cached_tokens"] for i in range(3)] == [0] + [by["a#s0"]["prompt_tokens"]] * 2
    summary = json.loads((path.parent / "summary.json").read_text())
    assert summary["prompt_tokens_cached"] == sum(r["cached_tokens"] or 0 for r in rows) > 0
    assert summary["prompt_tokens_prefilled"] == summary["prompt_tokens"] - summary["prompt_tokens_cached"]
    assert summary["engine"]["forks"] >= 5
    # the same job again in a new folder: the same outputs
    again, _ = run_app(*args, f"output.dir={tmp_path / 'again'}")
    assert [r["output_token_ids"] for r in pq.read_table(again).to_pylist()] == [r["output_token_ids"] for r in rows]


def test_greedy_samples_are_refused_not_duplicated():
    """n > 1 at temperature 0 would be n copies: the row is invalid_input (the job's n, or its own),
    a row sampling at its own temperature is not."""
    rows = [InputRow(0, "g", {"prompt": "p"}), InputRow(1, "own", {"prompt": "p", "n": 2}),
            InputRow(2, "warm", {"prompt": "p", "temperature": 0.7})]
    got = expand(rows, 3, temperature=0.0)
    assert [r.key for r in got] == ["g", "own", "warm#s0", "warm#s1", "warm#s2"]
    assert "n=3 with temperature 0 (greedy) would give 3 identical samples" in got[0].payload["error"]
    assert "n=2 with temperature 0" in got[1].payload["error"]


def test_expand_keys_positions_and_seeds():
    rows = [InputRow(0, "x", {"prompt": "p"}), InputRow(1, "x#s1", {"prompt": "q", "n": 1}),
            InputRow(2, "e", {"prompt": "", "error": "empty"})]
    got = expand(rows, 2)
    assert [(r.pos, r.key) for r in got] == [(0, "x#s0"), (1, "x#s1#"), (SAMPLE_SLOTS, "x#s1"), (2 * SAMPLE_SLOTS, "e")]
    assert got[1].payload == {"prompt": "p", "sample_index": 1, "group": "x"}
    assert seed_for({"prompt": "p"}, "k", 3) == derive_seed(3, "k")
    assert seed_for({"seed": 9}, "k", 3) == 9
    assert seed_for({"seed": 9, "sample_index": 2}, "k#s2", 3) == derive_seed(9, "k#s2")
