"""MLX CUDA: decode's new K/V stored by the fused kernel (engine.options.cuda.kernel_writes) gives
the same bits as storing them with scatters before the kernel (kernel_writes=false):
the same logits at every step, the same tokens, and the same pool and tail buffers after the
run. Rows cross several page seals (q8/q4: a step that seals a page stores with scatters, the
others in the kernel), rows are split (24-token splits) and unsplit, and more rows than slots
run (freed pages reused). Skipped off CUDA (the CPU path never takes this route)."""
from __future__ import annotations

import random

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.config import CudaLaunch, EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.testing import engine_config
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from tests.conftest import ON_CUDA, kv_cache

pytestmark = pytest.mark.skipif(not ON_CUDA, reason="the fused kernels run on MLX CUDA only")


def _run(tiny_model, mode: str, page: int, write: str, chunk: str, monkeypatch):
    launch = CudaLaunch(kernel_writes=write == "1", **({"chunk": int(chunk), "unsplit": int(chunk)} if chunk else {}))
    model, tok, spec = tiny_model(family="llama", head_dim=64)
    cfg = engine_config(kv_mode=mode, page_size=page, group_size=64, max_batch=4, prefill_chunk=100,
                        memory_budget=4 << 30, options=EngineOptions(cuda=launch))
    eng = Engine(model, tok, spec, cfg)
    cache = kv_cache(eng)  # the route under test and the buffers it writes
    assert cache.attention.launch.kernel_writes == (write == "1")
    rng = random.Random(5)
    reqs = []
    for i, n in enumerate((3, 17, 64, 70, 111, 40)):
        prompt = [rng.randrange(256) for _ in range(n)]
        forced = [rng.randrange(256) for _ in range(40 + 7 * i)]
        eng.hooks.force(f"r{i}", forced)
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=len(forced))))
    reqs.append(Request("g", [9, 8, 7], SamplingParams(max_tokens=90)))
    res = {r.key: r for r in eng.generate(reqs)}
    assert not [r.error_code for r in res.values() if r.error_code]
    return res, eng.hooks.logits, cache.store.all_arrays()  # pools (and q8/q4 tails) of every layer


@pytest.mark.parametrize("chunk", ["", "24"], ids=["default", "split24"])
@pytest.mark.parametrize("mode,page", [("none", 16), ("none", 64), ("q8", 16), ("q4", 64)])
def test_kernel_write_matches_scatter_write(tiny_model, monkeypatch, mode, page, chunk):
    a, logits_a, bufs_a = _run(tiny_model, mode, page, "1", chunk, monkeypatch)
    b, logits_b, bufs_b = _run(tiny_model, mode, page, "0", chunk, monkeypatch)
    for key, ra in a.items():
        rb = b[key]
        assert ra.tokens == rb.tokens, key
        assert ra.stats.route == rb.stats.route
        for la, lb in zip(logits_a.get(key, []), logits_b.get(key, [])):
            assert mx.array_equal(la, lb).item(), key
    assert len(bufs_a) == len(bufs_b)
    for x, y in zip(bufs_a, bufs_b):
        assert x.shape == y.shape and mx.array_equal(x, y).item()
