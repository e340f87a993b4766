"""MLX CUDA: decode's new K/V stored by the fused kernel (engine.options.cuda.kernel_writes) gives
the same bits as storing them with scatters before the kernel (kernel_writes=false):
the same logits at every step, the same tokens, and the same pool and tail buffers after the
run. Rows cross several page seals (q8/q4: the kernel stores the token that fills a tail and one
more launch seals it, against scatters and mx.quantize), rows are split (24-token splits) and
unsplit, and more rows than slots run (freed pages reused). Skipped off CUDA (the CPU path never
takes this route)."""
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


@pytest.mark.parametrize("bits", [8, 4, (8, 4)], ids=["q8", "q4", "k8v4"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_seal_kernel_gives_the_bits_of_mx_quantize(bits, dtype):
    """cuda_kernels.seal_tail_pages against QuantizedStore.seal_tail_pages (mx.quantize) on the same tails:
    groups of mixed signs, all negative, all positive, constant and zero; the pool's other pages untouched (a row
    whose tail does not fill this step seals nothing);
    the attention output passed through unchanged."""
    from kvbatch.engine.kv.routes.cuda_kernels import QuantPages, seal_tail_pages
    from kvbatch.engine.kv.store import QuantizedStore

    H, P, D, gs = 3, 16, 128, 64
    stores = [QuantizedStore(1, H, D, P, dtype, bits, gs, tail_slots=5) for _ in range(2)]
    mx.random.seed(3)
    tk = mx.random.normal((5, H, P, D)) * 3
    tv = mx.random.normal((5, H, P, D))
    tk[1] = mx.abs(tk[1]) + 0.5  # all positive
    tk[2] = -mx.abs(tk[2]) - 0.5  # all negative
    tv[3] = 0.25  # constant
    tv[4] = 0.0
    pool = [mx.random.randint(0, 1 << 30, (7, *a.shape[1:])).astype(a.dtype) for a in stores[0].q[0]]
    for st in stores:
        st.tk[0], st.tv[0] = tk.astype(dtype), tv.astype(dtype)
        st.q[0] = [a + 0 for a in pool]  # own buffers: the kernel writes its pool in place
        mx.eval(st.q[0])
    tails, dest = mx.array([4, 1, 2, 3, 0], dtype=mx.int32), mx.array([6, 0, 2, 5, 3], dtype=mx.int32)
    stores[0].seal_tail_pages(0, tails, dest)
    # the kernel's rows: these five at the last slot of their page number n % 3 (that page is dest[n]), and a
    # sixth whose tail does not fill; every other table entry names a page that must stay as it was (1 or 4)
    pos = [(n % 3) * P + P - 1 for n in range(5)] + [P + 3]
    table = [[1, 4, 1] for _ in range(6)]
    for n, d in enumerate(dest.tolist()):
        table[n][n % 3] = d
    table[5][1] = 6
    st = stores[1]
    out = mx.random.normal((2, 4, 1, 8)).astype(dtype)
    kb, vb = (bits, bits) if isinstance(bits, int) else bits
    got = seal_tail_pages(out, QuantPages(st.q[0], st.tk[0], st.tv[0], kb, gs, vb),
                          mx.array(tails.tolist() + [1], dtype=mx.int32), mx.array(table, dtype=mx.int32),
                          mx.array(pos, dtype=mx.int32))
    mx.eval(got)
    assert mx.array_equal(got, out).item()
    for name, want, have, before in zip(("kw", "ks", "kb", "vw", "vs", "vb"), stores[0].q[0], st.q[0], pool):
        assert mx.array_equal(want, have).item(), name
        assert mx.array_equal(have[mx.array([1, 4])], before[mx.array([1, 4])]).item(), name  # not sealed into
        assert not mx.array_equal(have[6], before[6]).item(), name
