"""The paged, batched engine on the real SmolLM2-135M-Instruct (issue 3): 4 chat rows x 128
greedy tokens give the same tokens as mlx-lm's single-stream generation."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvbatch.engine.engine import Engine
from kvbatch.engine.testing import engine_config
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

pytestmark = pytest.mark.smollm2

QUESTIONS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle works, part by part.",
    "List twenty interesting facts about the ocean.",
    "Describe a day in the life of a medieval baker, hour by hour.",
]
N = 128


def test_four_chat_rows_match_mlx_lm_greedy(smollm2):
    model, tok, spec = smollm2
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    eos = set(tok.eos_token_ids)
    expected = []
    for p in prompts:  # mlx-lm single stream, greedy, plain KVCache
        out = []
        for t, _ in generate_step(mx.array(p), model, max_tokens=N):
            if t in eos:
                break
            out.append(t)
        expected.append(out)

    eng = Engine(model, tok, spec, engine_config(page_size=16, max_batch=4, prefill_chunk=32,
                                                memory_budget=4 << 30))
    results = eng.generate([Request(f"q{i}", p, SamplingParams(max_tokens=N)) for i, p in enumerate(prompts)])
    for r, exp in zip(results, expected):
        assert r.ok, (r.key, r.error_code, r.error_message)
        assert r.tokens == exp, (r.key, tok.decode(r.tokens), tok.decode(exp))
        assert r.finish_reason == ("length" if len(exp) == N else "stop")
    assert sum(len(e) for e in expected) >= 3 * N  # long answers: most rows run the full 128 tokens
    s = eng.summary()
    assert s["peak_concurrency"] == 4 and s["pages_in_use"] == 0
    assert s["prefill_rows_max"] > 1  # ragged prompts shared prefill passes
