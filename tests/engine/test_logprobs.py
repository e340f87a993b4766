"""logprobs and prompt_logprobs (issue 24) on the tiny model, against mlx-lm's single-stream logits."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvbatch.engine import logprobs
from kvbatch.engine.engine import Engine
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config
from tests.engine.kv_reference import teacher_forced_logits

K = 5


def _prompts():
    return [[(17 * i + 3 * j + 1) % 256 for j in range(n)] for i, n in enumerate((9, 23, 4, 14))]


def _params(i: int) -> SamplingParams:
    sampled = dict(temperature=0.9, seed=i) if i % 2 else {}
    return SamplingParams(max_tokens=12 + i, logprobs=K, prompt_logprobs=True, **sampled)


def _run(m, reqs, **kw):
    return Engine(*m, engine_config(memory_budget=2 << 30, page_size=4, prefill_chunk=5, **kw)).generate(reqs)


def test_logprobs_equal_mlx_lm_log_softmax_and_batching_changes_nothing(tiny_model):
    m = tiny_model()
    model = m[0]
    prompts = _prompts()
    reqs = [Request(f"r{i}", p, _params(i)) for i, p in enumerate(prompts)]
    batched = _run(m, reqs, max_batch=4)
    alone = [_run(m, [r], max_batch=1)[0] for r in reqs]
    for i, (res, one) in enumerate(zip(batched, alone)):
        lp = res.logprobs
        assert res.ok and len(lp.tokens) == len(res.tokens) == len(lp.top) > 0
        assert one.tokens == res.tokens
        # batched and alone: the same tokens and alternatives, the same values up to float rounding (the
        # batch's matmuls sum in another order)
        assert max(abs(a - b) for a, b in zip(one.logprobs.tokens, lp.tokens)) < 1e-5
        assert [[t for t, _ in top] for top in one.logprobs.top] == [[t for t, _ in top] for top in lp.top]
        ref = teacher_forced_logits(model, prompts[i], res.tokens, lambda: make_prompt_cache(model))
        for step, (tok, raw) in enumerate(zip(res.tokens, ref)):
            L = raw - mx.logsumexp(raw)
            assert abs(lp.tokens[step] - L[tok].item()) < 1e-4, (i, step)
            top = lp.top[step]
            assert len(top) == K and len({t for t, _ in top}) == K
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))  # best first
            best = mx.argsort(-L)[:K].tolist()
            assert [t for t, _ in top] == best
            assert all(abs(v - L[t].item()) < 1e-4 for t, v in top)
            if not i % 2:  # greedy: the chosen token is the best
                assert top[0][0] == tok and top[0][1] == lp.tokens[step]
        # prompt: every token after the first, scored by mlx-lm's full forward over the prompt
        full = model(mx.array([prompts[i]]))[0].astype(mx.float32)
        Lp = full - mx.logsumexp(full, axis=-1, keepdims=True)
        want = [Lp[j, prompts[i][j + 1]].item() for j in range(len(prompts[i]) - 1)]
        assert len(lp.prompt) == len(want) and max(abs(a - b) for a, b in zip(lp.prompt, want)) < 1e-4
        assert lp.total == sum(lp.tokens)


def test_rows_without_logprobs_record_none(tiny_model):
    m = tiny_model()
    res = _run(m, [Request("a", _prompts()[0], SamplingParams(max_tokens=4)),
                   Request("b", _prompts()[1], SamplingParams(max_tokens=4, logprobs=2))])
    assert res[0].logprobs is None
    assert res[1].logprobs.prompt is None and len(res[1].logprobs.tokens) == 4
    assert all(len(t) == 2 for t in res[1].logprobs.top)


def test_top_k_over_a_large_vocabulary_equals_a_full_sort():
    """The two-stage top-k (blocks first) against argsort, with the vocabulary a multiple of the block
    size and not; and the log-sum-exp against MLX's."""
    for V in (49152, 10007):
        x = 4 * mx.random.normal((6, V), key=mx.random.key(V))
        for k in (1, 5, 20):
            ids, vals = logprobs.best_k(x, k)
            want = mx.argsort(-x, axis=-1)[:, :k]
            assert mx.array_equal(ids, want).item(), (V, k)
            assert mx.array_equal(vals, mx.take_along_axis(x, want, axis=-1)).item()
        assert mx.allclose(logprobs.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True), atol=1e-5).item()
