"""action=score (pipeline/score.py on engine/scoring.py): a completion's summed log-probability equals the
mlx-lm model's own single-stream log-softmax of the same tokens (no cache), on the random test model and
SmolLM2; a DPO-shaped file gives both columns; batched equals alone; a kill -9 mid-job, then the same
command again, gives every (row, column) once and the values of an uninterrupted run; bad rows and
configs fail as the rest of kvbatch does."""
from __future__ import annotations

import json
import math

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

import kvbatch
from kvbatch.engine import scoring
from kvbatch.engine.engine import Engine
from kvbatch.engine.scoring import ForcedRow
from kvbatch.engine.testing import engine_config
from kvbatch.pipeline import score
from kvbatch.pipeline.config import ConfigError, JobConfig
from tests.e2e.test_durable import check_files, kvbatch as run_cli

TOL = 1e-4
LONG = "Explain the paged KV cache in a few words, please, and keep it short. " * 2  # past a page of 16
DPO = [
    {"id": "p0", "prompt": LONG, "chosen": " Pages of keys and values.", "rejected": " No idea"},
    {"id": "p1", "prompt": "Two plus two?", "chosen": " Four.", "rejected": " Five, or maybe more than that."},
    {"id": "p2", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
     "chosen": " Hello!", "rejected": " Go away."},
    {"id": "p3", "prompt": "Only one answer here", "chosen": " yes"},  # no rejected: invalid_input for that one
    {"id": "p4", "prompt": "Bad answers", "chosen": "", "rejected": 5},  # empty, not text: invalid_input each
]
SETTINGS = {"kv.page_size": 16, "engine.prefill_chunk": 32}


def _opts(cache_dir, **more) -> dict:
    return {"model.cache_dir": str(cache_dir), **SETTINGS, **more}


def _reference(model, tok, row: dict, column: str) -> tuple[list[int], list[float]]:
    """The completion's tokens (the joint text's after the prompt's, rendered by the tokenizer here) and
    each one's log-probability from one plain forward of the mlx-lm model over prompt + completion."""
    msgs = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    completion = tok.encode(text + row[column], add_special_tokens=False)[len(prompt):]
    logits = np.asarray(model(mx.array([prompt + completion]))[0].astype(mx.float32)).astype(np.float64)
    # log-softmax in float64 (MLX's CPU logsumexp is ~2e-4 off over SmolLM2's 49,152 logits)
    m = logits.max(axis=-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    at = np.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return completion, [float(x) for x in lp[at, completion]]


def _check_against_mlx_lm(table, rows, model, tok, columns) -> None:
    out = table.to_pylist()
    assert [(r["row_index"], r["score_column"]) for r in out] == [(i, c) for i in range(len(rows)) for c in columns]
    for r in out:
        row = rows[r["row_index"]]
        if not isinstance(row.get(r["score_column"]), str) or not row[r["score_column"]]:
            assert r["error_code"] == "invalid_input" and r["score_column"] in r["error_message"], r
            assert r["finish_reason"] == "error" and r["cumulative_logprob"] is None
            continue
        ids, want = _reference(model, tok, row, r["score_column"])
        assert r["error_code"] is None and r["finish_reason"] == "scored", r
        assert r["output"] == row[r["score_column"]] and r["output_token_ids"] == ids and r["output_tokens"] == len(ids)
        assert r["cumulative_logprob"] == pytest.approx(math.fsum(want), abs=TOL), r["row_key"]
        assert r["mean_logprob"] == pytest.approx(r["cumulative_logprob"] / len(ids))
        assert r["perplexity"] == pytest.approx(math.exp(-r["mean_logprob"]))
        if r["output_logprobs"] is not None:
            assert max(abs(a - b) for a, b in zip(r["output_logprobs"], want)) <= TOL
            assert len(r["output_logprobs"]) == len(ids)


@pytest.fixture(scope="module")
def dpo_batched(model_cache_dir):
    return kvbatch.score(DPO, model="tiny", columns=["chosen", "rejected"], tokens=True, **_opts(model_cache_dir))


def test_dpo_file_scores_both_columns_as_mlx_lm_does(dpo_batched, tiny_model):
    model, tok, _ = tiny_model()
    _check_against_mlx_lm(dpo_batched, DPO, model, tok, ["chosen", "rejected"])
    out = {r["row_key"]: r for r in dpo_batched.to_pylist()}
    assert sorted(out) == sorted(f"p{i}#{c}" for i in range(len(DPO)) for c in ("chosen", "rejected"))
    assert [out[f"p4#{c}"]["error_message"] for c in ("chosen", "rejected")] == \
        ["empty chosen: nothing to score", "rejected must be a string to score, got int"]
    assert out["p0#chosen"]["chosen"] == DPO[0]["chosen"]  # the input's columns carried through
    # the second completion of the long prompt took its first page from the first one's
    assert out["p0#rejected"]["cached_tokens"] + out["p0#chosen"]["cached_tokens"] >= 16
    assert out["p2#chosen"]["messages"][-1] == {"role": "assistant", "content": " Hello!"}


ALONE = {"engine.max_batch": 1, "engine.prefix_cache": False, "worker.prefetch": 0}


@pytest.fixture(scope="module")
def dpo_alone(model_cache_dir):
    """Every completion scored alone: a batch of one, nothing shared or cached."""
    return kvbatch.score(DPO, model="tiny", columns=["chosen", "rejected"], tokens=True,
                         **_opts(model_cache_dir, **ALONE))


def test_batched_equals_alone(dpo_batched, dpo_alone):
    alone = dpo_alone
    assert sum(alone.column("cached_tokens").to_pylist()[:2]) == 0
    for a, b in zip(alone.to_pylist(), dpo_batched.to_pylist()):
        assert (a["row_key"], a["output_token_ids"], a["error_code"]) == \
            (b["row_key"], b["output_token_ids"], b["error_code"])
        if b["error_code"] is None:
            assert a["cumulative_logprob"] == pytest.approx(b["cumulative_logprob"], abs=1e-5)
            assert max(abs(x - y) for x, y in zip(a["output_logprobs"], b["output_logprobs"])) <= 1e-5


@pytest.mark.smollm2
def test_smollm2_scores_as_mlx_lm_does(smollm2):
    """The engine's scorer (what action=score runs) on the real SmolLM2, against its mlx-lm forward."""
    model, tok, spec = smollm2
    rows = [{"prompt": "What is the capital of France?", "completion": "The capital of France is Paris."},
            {"prompt": "Name a colour.", "completion": "Blue, like the sky."}]
    eng = Engine(model, tok, spec, engine_config(page_size=16, prefill_chunk=32, memory_budget=2 << 30))
    forced, want = [], []
    for i, row in enumerate(rows):
        ids, lp = _reference(model, tok, row, "completion")
        prompt = score.tokens(tok, {**row, "score_column": "completion"}, JobConfig())[0]
        forced.append(ForcedRow(f"r{i}", prompt, ids))
        want.append(lp)
    # jointly tokenized: a token that spans the boundary ("Say hel" + "lo world": " hello") is the completion's
    prompt, text = score.tokens(tok, {"prompt": "Say hel", "completion": "lo world", "score_column": "completion"},
                                JobConfig(chat_template=False))
    assert prompt + text == tok.encode("Say hello world") and tok.decode(text) == " hello world"
    got = scoring.score(eng, forced)
    for i, lp in enumerate(want):
        mine = got[f"r{i}"].token_logprobs()
        assert mine is not None and max(abs(a - b) for a, b in zip(mine, lp)) <= TOL
        assert math.fsum(mine) == pytest.approx(math.fsum(lp), abs=TOL)


def test_bad_settings_fail_in_one_line(model_cache_dir):
    for cols, says in (([], "needs 1 to"), (["prompt"], "is the row's prompt"), (["a", "a"], "distinct")):
        with pytest.raises(ConfigError, match=says) as e:
            kvbatch.score(DPO, model="tiny", columns=cols, **_opts(model_cache_dir))
        assert "\n" not in str(e.value) and str(e.value).startswith("job.score_columns=")
    with pytest.raises(ConfigError, match=r"no column 'answer' in input.jsonl to score; columns: \[.*'chosen'"):
        kvbatch.score(DPO, model="tiny", columns=["chosen", "answer"], **_opts(model_cache_dir))
    for key, value in (("sampling.n", 2), ("sampling.logprobs", 3), ("job.response_format", "json_object")):
        with pytest.raises(ConfigError, match=rf"^{key}=.*action=score scores given text"):
            kvbatch.score(DPO, model="tiny", **_opts(model_cache_dir, **{key: value, "sampling.temperature": 1.0}))


def test_kill_9_then_the_same_command_gives_every_score_once_and_exact(tmp_path, model_cache_dir, dpo_alone):
    """Rows alone (ALONE): an uninterrupted run's values are exactly reproducible, so exact is asserted."""
    src = tmp_path / "dpo.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in DPO))
    args = ["action=score", "model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}",
            "job.score_columns=[chosen,rejected]", "job.score_tokens=true", "kv.page_size=16",
            "engine.prefill_chunk=32", "engine.max_batch=1", "engine.prefix_cache=false", "worker.prefetch=0",
            "worker.flush_rows=2",
            "worker.flush_s=1000", "output.progress=off"]
    out = tmp_path / "out"
    killed = run_cli(out, args, crash="after_part_write:2")  # the second part durable, not acknowledged
    assert killed.returncode == -9, killed.stderr
    assert not (out / "results.parquet").exists()
    rows = kvbatch.score(str(src), model="tiny", columns=["chosen", "rejected"], tokens=True, output_dir=out,
                         **_opts(model_cache_dir, **ALONE, **{"worker.flush_rows": 2, "worker.flush_s": 1000}))
    rows = rows.to_pylist()
    assert check_files(out) == []
    assert len(list((out / "parts").glob("*.parquet"))) >= 3  # the parts before the kill kept, not rerun
    want = dpo_alone.to_pylist()
    assert [r["row_key"] for r in rows] == [r["row_key"] for r in want]
    for r, w in zip(rows, want):
        assert (r["output_token_ids"], r["error_code"], r["output_logprobs"], r["cumulative_logprob"]) == \
            (w["output_token_ids"], w["error_code"], w["output_logprobs"], w["cumulative_logprob"]), r["row_key"]
