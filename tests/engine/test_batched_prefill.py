"""Batched, ragged prefill: several rows' prompt chunks in one right-padded pass give the same
logits as prefilling one row a pass, on every KV mode and page size."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.backend import on_cpu
from kvbatch.engine.engine import Engine
from kvbatch.engine.types import Request, SamplingParams
from tests.conftest import engine_config
from tests.engine.test_engine_paged import prompts_of

# kv none: float tolerance. q8/q4: where a key computed in a differently shaped pass sits on a
# quantization rounding boundary, it rounds one step apart: the bound the KV-quant tests allow such a
# step (seen on MLX CUDA at q4). On the CPU every mode is held to 1e-4.
TOL = {"none": 1e-4, "q8": 10e-4, "q4": 170e-4} if not on_cpu() else {"none": 1e-4, "q8": 1e-4, "q4": 1e-4}
LENGTHS = [37, 3, 70, 12, 1, 55]  # ragged: chunks of 16 pad short rows in every shared pass
STEPS = 6


def _run(m, mode: str, page: int, prefill_tokens, max_batch: int = 8, lengths=tuple(LENGTHS)):
    model, tok, spec = m
    eng = Engine(model, tok, spec, engine_config(kv_mode=mode, page_size=page, max_batch=max_batch, prefill_chunk=16,
                                                memory_budget=2 << 30, prefill_tokens=prefill_tokens))
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
