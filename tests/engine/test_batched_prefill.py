"""Batched, ragged prefill: several rows' prompt chunks in one right-padded pass give the same
logits as prefilling one row a pass, on every KV mode and page size."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.engine import Engine
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config
from tests.conftest import kv_cache
from tests.engine.test_engine_paged import prompts_of

# kv none: float tolerance. q8/q4: a key computed in a differently shaped pass (a GEMM of other
# rows, other blocking) can differ in its last bits, and where it sits on a quantization rounding
# boundary it rounds one step apart: the bound the KV-quant tests allow such a step. Which keys flip
# depends on the host's BLAS kernels (seen at q8 on an AMD EPYC CPU and at q4 on MLX CUDA).
TOL = {"none": 1e-4, "q8": 10e-4, "q4": 170e-4}
LENGTHS = [37, 3, 70, 12, 1, 55]  # ragged: chunks of 16 pad short rows in every shared pass
STEPS = 6


def _run(m, mode: str, page: int, prefill_tokens, max_batch: int = 8, lengths=tuple(LENGTHS), composed=None):
    model, tok, spec = m
    eng = Engine(model, tok, spec, engine_config(kv_mode=mode, page_size=page, max_batch=max_batch, prefill_chunk=16,
                                                memory_budget=2 << 30, prefill_tokens=prefill_tokens))
    if composed is not None:  # the CUDA routes' prefill attention, on any backend
        kv_cache(eng).attention.composed = composed  # the route's own switch (no option sets it)
    prompts = prompts_of(list(lengths), salt=5)
    forced = [[(11 * i + 3 * j) % 256 for j in range(STEPS)] for i in range(len(prompts))]
    for i, f in enumerate(forced):
        eng.hooks.force(f"r{i}", f)
    res = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=STEPS)) for i, p in enumerate(prompts)])
    assert all(r.ok and r.tokens == f for r, f in zip(res, forced))
    return {k: mx.stack(v) for k, v in eng.hooks.logits.items()}, eng.summary()


@pytest.mark.parametrize("mode", ["none", "q8", "q4"])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("family,head_dim", [("llama", 64), ("qwen3", 128)])
def test_batched_prefill_matches_one_row_prefill(tiny_model, family, head_dim, mode, page):
    m = tiny_model(family=family, head_dim=head_dim)
    alone, s_alone = _run(m, mode, page, prefill_tokens=1)  # one row a prefill pass
    batched, s_batched = _run(m, mode, page, prefill_tokens="auto")
    assert s_alone["prefill_rows_max"] == 1
    assert s_batched["prefill_rows_max"] == len(LENGTHS)  # every row's first chunk in one pass
    assert s_batched["prefill_passes"] < s_alone["prefill_passes"]
    assert s_batched["prefill_tokens_total"] == s_alone["prefill_tokens_total"] == sum(LENGTHS)
    for key, a in alone.items():
        assert a.shape == batched[key].shape == (STEPS, m[2].vocab_size)
        assert mx.abs(a - batched[key]).max().item() <= TOL[mode], key


@pytest.mark.parametrize("mode", ["none", "q8", "q4"])
def test_rows_admitted_mid_prefill_share_passes(tiny_model, mode):
    """Four slots: rows admitted as others finish share passes with rows half-way through their
    prompts (q8/q4: the rows at position 0 go together, the others row by row, in one pass)."""
    m = tiny_model(family="qwen3", head_dim=128)
    lengths = (200, 3, 5, 2, 40, 7, 1, 9, 20)  # the 200-token prompt takes 13 passes of 16
    alone, _ = _run(m, mode, 16, prefill_tokens=1, max_batch=4, lengths=lengths)
    batched, s = _run(m, mode, 16, prefill_tokens="auto", max_batch=4, lengths=lengths)
    assert s["prefill_rows_max"] > 1
    for key, a in alone.items():
        assert mx.abs(a - batched[key]).max().item() <= TOL[mode], key


def test_long_prompts_batch_their_later_chunks_alike_in_every_kv_mode(tiny_model):
    """Where the budget has room, a pass takes every long prompt's next chunk however much context it attends
    to: kv none and q8/q4 (whose priced decode workspace is a fraction of none's) run the same passes, each
    within the budget; where the budget is only what the rows' worst cases and their priced workspace need,
    later chunks (larger scores) fit fewer to a pass."""
    m = tiny_model(num_layers=2)
    lengths = (150,) * 6  # 10 chunks of 16 a row
    passes = {}
    for mode in ("none", "q8", "q4"):
        _, s = _run(m, mode, 16, prefill_tokens=96, lengths=lengths)
        passes[mode] = (s["prefill_passes"], s["prefill_rows_max"])
        assert s["mlx_peak_memory_bytes"] <= s["budget_bytes"]
    assert passes == {mode: (10, 6) for mode in passes}
    model, tok, spec = m
    probe = Engine(model, tok, spec, engine_config(kv_mode="q8", page_size=16, max_batch=8, prefill_chunk=16,
                                                  memory_budget=2 << 30, prefill_tokens=96))
    tight = probe.memory.bytes_for([150 + STEPS] * 6, 150)
    eng = Engine(model, tok, spec, engine_config(kv_mode="q8", page_size=16, max_batch=8, prefill_chunk=16,
                                                memory_budget=tight, prefill_tokens=96))
    res = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=STEPS))
                        for i, p in enumerate(prompts_of(list(lengths), salt=5))])
    s = eng.summary()
    assert all(r.ok for r in res) and s["prefill_passes"] > 10


@pytest.mark.parametrize("mode,family,head_dim", [("none", "llama", 64), ("none", "qwen3", 128), ("q8", "qwen3", 128)])
def test_composed_prefill_attention_matches_fused(tiny_model, mode, family, head_dim):
    """The CUDA routes prefill through dense.composed_attention (matmuls, no cuDNN graph per shape):
    the same logits as MLX's fused SDPA, batched ragged passes included."""
    m = tiny_model(family=family, head_dim=head_dim)
    fused, _ = _run(m, mode, 16, prefill_tokens="auto", composed=False)
    composed, _ = _run(m, mode, 16, prefill_tokens="auto", composed=True)
    for key, a in fused.items():
        assert mx.abs(a - composed[key]).max().item() <= TOL[mode], key


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
def test_composed_attention_equals_sdpa(dtype, tol):
    """Grouped query heads, ragged right-padded rows: the real queries' outputs equal fused SDPA's;
    padded queries that see no key stay finite."""
    from kvbatch.engine.kv.routes.common import causal_mask
    from kvbatch.engine.kv.routes.dense import composed_attention
    import numpy as np

    B, Hq, Hkv, L, T, D = 3, 8, 2, 5, 12, 32
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)).astype(dtype)
               for i, s in enumerate([(B, Hq, L, D), (B, Hkv, T, D), (B, Hkv, T, D)]))
    pos = np.array([0, 4, 7])  # row 0: 5 real queries at 0..4; its keys past 4 are masked
    mask = causal_mask(pos, L, T, 1)
    mask = mask & (mx.arange(T)[None, None, None] < mx.array([5, 9, 12])[:, None, None, None])
    lens = [5, 3, 5]
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    out = composed_attention(q, k, v, mask, 0.125)
    assert out.dtype == dtype and out.shape == ref.shape
    for b, n in enumerate(lens):
        err = mx.abs(out[b, :, :n].astype(mx.float32) - ref[b, :, :n].astype(mx.float32)).max().item()
        assert err <= tol, (b, err)
    dead = mx.zeros((1, 1, 2, T), dtype=mx.bool_)  # queries that see no key at all
    assert mx.isfinite(composed_attention(q[:1, :, :2], k[:1], v[:1], dead, 0.125)).all().item()
