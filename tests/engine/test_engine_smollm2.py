"""The paged, batched engine on the real SmolLM2-135M-Instruct (issue 3): 4 chat rows x 128
greedy tokens give the same tokens as mlx-lm's single-stream generation.

mlx-lm generates the first row step by step (as generate() does); every row, that one included, is
also checked teacher-forced: one mlx-lm forward pass over prompt + the engine's answer, whose argmax
at every position must be the engine's next token (and an end-of-sequence token where the engine
stopped). For greedy decoding that is the same statement as "mlx-lm generates these tokens", at a
quarter of the single-stream decode steps (they took 3/4 of this test)."""
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
    first = []
    for t, _ in generate_step(mx.array(prompts[0]), model, max_tokens=N):  # mlx-lm single stream, greedy
        if t in eos:
            break
        first.append(t)

    eng = Engine(model, tok, spec, engine_config(page_size=16, max_batch=4, prefill_chunk=32,
                                                memory_budget=4 << 30))
    results = eng.generate([Request(f"q{i}", p, SamplingParams(max_tokens=N)) for i, p in enumerate(prompts)])
    assert results[0].tokens == first, (tok.decode(results[0].tokens), tok.decode(first))
    for r, p in zip(results, prompts):
        assert r.ok, (r.key, r.error_code, r.error_message)
        # mlx-lm, plain causal attention, no cache: its greedy choice after every prefix of the answer
        greedy = mx.argmax(model(mx.array([p + r.tokens]))[0, len(p) - 1:], axis=-1).tolist()
        assert greedy[:-1] == r.tokens, (r.key, tok.decode(r.tokens), tok.decode(greedy))
        if len(r.tokens) < N:  # mlx-lm stops where the engine did: its next choice ends the answer
            assert greedy[-1] in eos, (r.key, greedy[-1])
        assert r.finish_reason == ("length" if len(r.tokens) == N else "stop")
    assert sum(len(r.tokens) for r in results) >= 3 * N  # long answers: most rows run the full 128 tokens
    s = eng.summary()
    assert s["peak_concurrency"] == 4 and s["pages_in_use"] == 0
    assert s["prefill_rows_max"] > 1  # ragged prompts shared prefill passes
