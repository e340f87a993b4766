"""KV quantization q8/q4 on the paged cache (issue 5), on tiny float32/float16 models.

What is proven here:
- every (family, head size, mode) entry of engine/gate.py's VALIDATED table, in
  batches of 8 rows with different prompt lengths, at page sizes 16 and 64 and
  a prefill chunk shorter than some prompts, gives teacher-forced logits that
  match tests/engine/kv_reference.py within 1e-4 at every step (see `_check_row` for
  the two references and why both are needed);
- continuous batching (more rows than max_batch, freed pages reused) and a
  row's independence from its batch mates and from when the pool grew;
- decode never dequantizes: zero dequantize calls while the pool holds many
  quantized pages, and the quantized_matmul route (CPU) or the fused kernel reading
  the packed pages (MLX CUDA) is the one that runs;
- fp16 safety: huge attention scores stay finite with kv none/q8/q4, where
  MLX's CPU SDPA on the same fp16 q/k gives NaN/inf;

Routes are those of the backend the tests run on (tests/conftest.py: expected_route).
- the route reported per row and in the summary is the route that ran;
- the gate refuses unvalidated pairs with one line, unless allow_unvalidated.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.config import CudaLaunch, EngineOptions
from kvbatch.engine.kv.routes import cpu_streams, cuda, dense, portable
from kvbatch.engine.engine import Engine
from kvbatch.engine.testing import engine_config
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.gate import VALIDATED
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.load import load_model
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.kv.routes.cuda import ROUTE_CUDA, ROUTE_CUDA_Q
from kvbatch.engine.kv.routes.dense import ROUTE_DENSE, ROUTE_DENSE_F32
from kvbatch.engine.kv.routes.quant import ROUTE_QMM
from tests.conftest import ON_CPU, ON_CUDA, cpu_only, expected_route, kv_cache
from tests.engine.kv_reference import QuantRefCache, StoredPagesRefCache, teacher_forced_logits

TOL = 1e-4
# Stored K/V elements allowed one quantization step from the reference's own rounding. A flip moves
# later hidden states by ~1e-4, so flips cascade a little (seen: 0-0.08% of elements, 1.3% once, at q8
# p16 on an AMD EPYC); a quantizer that rounded the wrong way (floor, or a scale off by a step) would
# put about half of them a step away.
FLIP_SHARE = 0.05
BITS = {"q8": 8, "q4": 4}
BUDGET = 4 << 30
# Prompt lengths of the 8 rows (some longer than the prefill chunk, some shorter than a page)
# and their teacher-forced output lengths: rows end at 51..306 tokens, so at page size 64
# the long rows cross four page boundaries, and at 16 every row crosses several.
PROMPT_LENS = (3, 29, 64, 70, 111, 150, 190, 230)
STEPS = tuple(48 + 4 * i for i in range(8))
CHUNK = {16: 40, 64: 100}  # not multiples of the page size: chunks end mid-page

CASES = [(fam, hd, mode, page, 64)
         for (fam, hd), modes in sorted(VALIDATED.items())
         for mode in ("q8", "q4") if mode in modes
         for page in (16, 64)]
CASES += [("llama", 128, "q8", 16, 32), ("qwen3", 128, "q4", 64, 128)]


def _model(tiny_model, family: str, head_dim: int):
    return tiny_model(family=family, head_dim=head_dim)


def _rows(seed: int, prompt_lens=PROMPT_LENS, steps=STEPS):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in prompt_lens]
    forced = [[rng.randrange(256) for _ in range(s)] for s in steps]
    return prompts, forced


def _requests(eng, prompts, forced, prefix="r"):
    """Teacher-forced requests (their logits kept in eng.hooks.logits)."""
    for i, f in enumerate(forced):
        eng.hooks.force(f"{prefix}{i}", f)
    return [Request(f"{prefix}{i}", p, SamplingParams(max_tokens=len(f)))
            for i, (p, f) in enumerate(zip(prompts, forced))]


def _engine(model, tok, spec, mode, page, group=64, max_batch=8, chunk=None, hooks=None, **kw):
    cfg = engine_config(kv_mode=mode, page_size=page, group_size=group, max_batch=max_batch,
                       prefill_chunk=chunk or CHUNK.get(page, 40), memory_budget=BUDGET, **kw)
    return Engine(model, tok, spec, cfg, hooks)


class PageSnapshots:
    """Copies each row's stored quantized pages when the engine releases the row, before any
    other row can reuse them; `store(key)` looks like a QuantizedStore holding only that row's
    pages, numbered 0..n-1 (what StoredPagesRefCache reads)."""

    def __init__(self, cache):
        self.src, self.rows = cache.store, {}
        release = cache.release

        def keep(row, *args, **kw):
            if row.pages:
                pages = mx.array(row.pages)  # buffers are (pages, kv_heads, page_size, width)
                q = [[a[pages] for a in layer] for layer in self.src.q]
                mx.eval(q)
                self.rows[row.key] = (q, row.length)
            release(row, *args, **kw)

        cache.release = keep

    def store(self, key: str):
        q, _ = self.rows[key]
        s = self.src
        return SimpleNamespace(q=q, page_size=s.page_size, group_size=s.group_size, key_bits=s.key_bits,
                               value_bits=s.value_bits, k_axis=s.k_axis)

    def n_pages(self, key: str) -> int:
        return self.rows[key][0][0][0].shape[0]


def _quant_ref(model, prompt, forced, page, bits, group, chunk, k_axis="token"):
    caches = [QuantRefCache(page, bits, group, k_axis) for _ in model.layers]
    logits = teacher_forced_logits(model, prompt, forced, lambda: caches, chunk)
    return logits, caches


def _first_flip(snap: PageSnapshots, key: str, ref_caches, page: int, bits: int,
                group: int) -> tuple[int, int, int]:
    """(first, flipped, stored): the first token position of the first sealed page whose stored
    (engine) quantization differs from the quantization of QuantRefCache's own keys by more
    than float rounding (the row length when there is none), and how many of the stored K/V
    elements differ, of how many. Also checks that any difference is at most one quantization
    step (a rounding flip), never more."""
    q, length = snap.rows[key]
    n_sealed = length // page
    first, flipped, stored = length, 0, 0
    if not n_sealed:
        return first, flipped, stored
    by_channel = snap.src.k_axis == "channel"
    for layer, rc in enumerate(ref_caches):
        assert rc.offset == length
        for which, raw in ((0, rc.keys), (3, rc.values)):
            raw = raw[0, :, : n_sealed * page]  # (H, T, D)
            eng = mx.dequantize(*(a[:n_sealed] for a in q[layer][which:which + 3]), group_size=group, bits=bits)
            if which == 0 and by_channel:  # quantized along each page's tokens: compare as (n, H, D, P)
                raw = raw.reshape(raw.shape[0], n_sealed, page, -1).transpose(1, 0, 3, 2)
            else:  # along D: compare as (T, H, D); engine pages (n, H, P, D) -> (T, H, D)
                raw = raw.transpose(1, 0, 2)
                eng = eng.transpose(0, 2, 1, 3).reshape(n_sealed * page, *eng.shape[1::2])
            rq = mx.quantize(raw, group_size=group, bits=bits)
            ref = mx.dequantize(*rq, group_size=group, bits=bits)
            diff = mx.abs(eng - ref)
            step = mx.abs(mx.repeat(rq[1], group, axis=-1))  # each element's quantization step (scales may be < 0)
            if which == 0 and by_channel:  # back to (T, H, D) for the per-token flip search
                diff = diff.transpose(0, 3, 1, 2).reshape(n_sealed * page, *diff.shape[1:3])
                step = step.transpose(0, 3, 1, 2).reshape(n_sealed * page, *step.shape[1:3])
            assert (diff <= 1.01 * step + 1e-5).all().item(), "stored page differs by more than one step"
            flipped += int((diff > 1e-5).sum().item())
            stored += diff.size
            bad_tok = mx.array(diff.reshape(diff.shape[0], -1).max(axis=1) > 1e-5)
            if bad_tok.any().item():
                pos = int(mx.argmax(bad_tok).item())
                first = min(first, (pos // page) * page)
    return first, flipped, stored


def _sealed_before(step: int, n_prompt: int, page: int, chunk: int) -> int:
    """Tokens in pages sealed before the pass that produced this step's logits."""
    if step == 0:
        return (((n_prompt - 1) // chunk) * chunk // page) * page
    return ((n_prompt + step - 1) // page) * page


def _check_row(model, res, logits, prompt, forced, snap, page, bits, group, chunk) -> tuple[int, int, int, int]:
    """Two references, both single-stream mlx-lm KVCache with plain full attention:

    - QuantRefCache: pages sealed before each call replaced by the quantize->dequantize
      round trip of the reference's *own* keys. The engine computes those keys in another
      (equally valid) float order (batched matmuls, quantized_matmul attention), so now
      and then a key sits on a rounding boundary and the two round it one step apart
      (seen: up to 1.5e-4 on logits, with the stored-pages reference at 8e-7). So: the
      engine's stored pages must equal the reference's quantization except for such
      one-step flips, and every step that attends to no flipped page must match within TOL.
    - StoredPagesRefCache: the same, but the sealed pages are the engine's *stored* pages,
      dequantized. Every step must match within TOL: paging and batching add nothing.

    Returns (steps checked against QuantRefCache, steps, K/V elements whose quantization flipped,
    K/V elements stored).
    """
    assert res.ok and res.finish_reason == "length", (res.error_code, res.error_message)
    assert len(logits) == len(forced)
    q_ref, caches = _quant_ref(model, prompt, forced, page, bits, group, chunk, snap.src.k_axis)
    store = snap.store(res.key)
    s_ref = teacher_forced_logits(
        model, prompt, forced,
        lambda: [StoredPagesRefCache(store, i, list(range(snap.n_pages(res.key)))) for i in range(len(model.layers))],
        chunk)
    flip, flipped, stored = _first_flip(snap, res.key, caches, page, bits, group)
    checked, worst = 0, 0.0
    for step, (got, a, b) in enumerate(zip(logits, q_ref, s_ref)):
        d_stored = mx.abs(got - b).max().item()
        worst = max(worst, d_stored)
        assert d_stored <= TOL, f"{res.key} step {step}: stored-pages reference differs by {d_stored:.2e}"
        d = mx.abs(got - a).max().item()
        if _sealed_before(step, len(prompt), page, chunk) <= flip:
            assert d <= TOL, f"{res.key} step {step}: QuantRefCache reference differs by {d:.2e}"
            checked += 1
        else:  # a one-step rounding flip moves logits by ~1e-4 at q8 (seen: 1.5e-4); a q4 step is
            # 17x coarser (15 vs 255 levels; seen: 1.0e-3 with per-channel keys)
            bound = 10 * TOL if bits == 8 else 170 * TOL
            assert d <= bound, f"{res.key} step {step}: QuantRefCache reference differs by {d:.2e}"
    return checked, len(forced), flipped, stored


# The portable route (engine.options.route=portable: what Apple's Metal backend runs: decode reads
# packed pages in place with gather_qmm, prefill as QuantRoute, keys per token, one stream) against the
# same references, on every backend.
PORTABLE = [("llama", 64, "q8", 16, 64), ("llama", 64, "q4", 64, 64), ("qwen3", 128, "q8", 64, 64)]
ALL_CASES = [c + ("auto",) for c in CASES] + [c + ("portable",) for c in PORTABLE]


@pytest.mark.parametrize("family,head_dim,mode,page,group,route", ALL_CASES,
                         ids=[f"{f}-h{h}-{m}-p{p}-g{g}" + ("-portable" if r == "portable" else "")
                              for f, h, m, p, g, r in ALL_CASES])
def test_batched_logits_match_reference(tiny_model, family, head_dim, mode, page, group, route):
    model, tok, spec = _model(tiny_model, family, head_dim)
    prompts, forced = _rows(seed=head_dim + page + group)
    if route == "portable" and ON_CUDA:  # quantized_matmul is not validated on MLX CUDA: the gate refuses it
        with pytest.raises(KvbatchConfigError, match="not validated on the MLX cuda backend"):
            _engine(model, tok, spec, mode, page, group, options=EngineOptions(route=route))
        return
    eng = _engine(model, tok, spec, mode, page, group, options=EngineOptions(route=route))
    cache = kv_cache(eng)  # the route under test and the pages it stores
    if route == "portable":  # no CPU-only reads, no CUDA kernel, keys per token, one stream
        a = cache.attention
        assert type(a) is portable.PortableQuantRoute and not a.in_place and a.streams == [None]
        assert eng.stats()["kv_k_axis"] == "token"
    snap = PageSnapshots(cache)
    results = eng.generate(_requests(eng, prompts, forced))
    s = eng.summary()
    route = expected_route(spec, mode, group, route)
    assert s["peak_concurrency"] == 8 and s["route"] == route
    assert {r.stats.route for r in results} == {route}
    sealed = [(len(p) + len(f) - 1) // page for p, f in zip(prompts, forced)]
    assert max(sealed) >= 4 and sum(s >= 2 for s in sealed) >= 4  # rows cross several page boundaries
    checked = total = flipped = stored = 0
    for res, p, f in zip(results, prompts, forced):
        assert snap.n_pages(res.key) == -(-(len(p) + len(f) - 1) // page)
        c, n, fl, st = _check_row(model, res, eng.hooks.logits[res.key], p, f, snap, page, BITS[mode], group,
                                  CHUNK[page])
        checked, total, flipped, stored = checked + c, total + n, flipped + fl, stored + st
    # the engine's stored pages are the reference's quantization but for rare one-step flips. Which
    # step meets the first flip is chaotic and depends on the host's float kernels (the strict
    # comparison covered 37-100% of steps on earlier hosts, 16% at q8 p16 on an AMD EPYC), so the
    # bound is on the flips themselves
    assert stored and flipped <= FLIP_SHARE * stored, f"{flipped}/{stored} stored K/V elements flipped"


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_continuous_batching_reuses_pages(tiny_model, mode):
    """12 rows through max_batch=3: rows end at different steps, waiting rows are admitted
    mid-flight into freed (dirty) pages, the pool grows while rows are running."""
    model, tok, spec = _model(tiny_model, "llama", 64)
    lens = (3, 29, 64, 70, 111, 150, 20, 45, 90, 17, 130, 61)
    steps = (40, 70, 44, 52, 66, 48, 75, 41, 59, 63, 45, 50)
    prompts, forced = _rows(seed=7, prompt_lens=lens, steps=steps)
    eng = _engine(model, tok, spec, mode, 16, max_batch=3)
    snap = PageSnapshots(kv_cache(eng))  # the pages each row stored
    order = []
    for req in _requests(eng, prompts, forced):
        eng.add(req)
    by_key = {}
    for res in eng.run():
        order.append(res.key)
        by_key[res.key] = res
    s = eng.summary()
    assert s["peak_concurrency"] == 3 and len(by_key) == 12
    assert order != sorted(order, key=lambda k: int(k[1:]))  # rows finished out of submission order
    assert s["peak_pages_in_use"] < sum(-(-(a + b) // 16) for a, b in zip(lens, steps))  # pages were reused
    assert len(s["growth_events"]) >= 2
    for i, (p, f) in enumerate(zip(prompts, forced)):
        _check_row(model, by_key[f"r{i}"], eng.hooks.logits[f"r{i}"], p, f, snap, 16, BITS[mode], 64, CHUNK[16])


@pytest.mark.parametrize("chunk", ["", "24"], ids=["default", "split24"])
@pytest.mark.parametrize("mode", ["none", "q8", "q4"])
def test_row_independent_of_batch_mates_and_pool_growth(tiny_model, monkeypatch, mode, chunk):
    """A row's logits do not depend on which rows share its batch or when the pool grew: the same
    to float tolerance and the same greedy tokens (not bit-identical: the batch sizes it decodes
    in and the shapes of the prefill passes it shares depend on its mates, and OpenBLAS rounds a
    matmul row differently for some shapes). A page-table or mask bug mixing rows is far above it.

    On MLX CUDA the fused decode kernel splits long rows over several blocks (split-K);
    "split24" forces 24-token splits, so every row here is split, into as many splits as
    its own length gives, while the longest row of the batch differs between the runs."""
    if chunk and not ON_CUDA:
        pytest.skip("engine.options.cuda.chunk only changes MLX CUDA's fused decode kernel")
    opts = EngineOptions(cuda=CudaLaunch(chunk=int(chunk), unsplit=int(chunk))) if chunk else EngineOptions()
    model, tok, spec = _model(tiny_model, "llama", 64)
    (x,), (fx,) = _rows(seed=3, prompt_lens=(83,), steps=(60,))
    greedy = Request("x", x, SamplingParams(max_tokens=60))

    def run(mates_lens, warm_tokens=0, max_batch=8):
        eng = _engine(model, tok, spec, mode, 16, max_batch=max_batch, options=opts)
        if warm_tokens:  # grow the pool first and leave stale data in its pages
            eng.generate([Request("warm", [7] * warm_tokens, SamplingParams(max_tokens=4))])
            assert eng.summary()["pool_capacity_pages"] >= warm_tokens // 16
        mates, mf = _rows(seed=len(mates_lens) + sum(mates_lens), prompt_lens=mates_lens,
                          steps=(60,) * len(mates_lens))
        reqs = _requests(eng, mates, mf, prefix="m")
        eng.hooks.force("x", fx)
        reqs.insert(len(reqs) // 2, Request("x", x, SamplingParams(max_tokens=60)))
        res = {r.key: r for r in eng.generate(reqs)}
        g = eng.generate([greedy])[0]
        return res["x"], eng.hooks.logits["x"], g, eng.summary()

    a, a_logits, ga, sa = run((5, 40, 70, 9, 120, 33, 64))
    b, b_logits, gb, sb = run((200, 3, 16, 150, 48, 99, 31), warm_tokens=700)
    grown = [[e["to_pages"] for e in x["growth_events"]] for x in (sa, sb)]
    assert len(grown[0]) > 1 and grown[0] != grown[1]
    assert a.stats.route == b.stats.route == sa["route"]
    assert len(a_logits) == len(b_logits)  # the forced run, then the greedy one (same key)
    assert max(mx.abs(p - q).max().item() for p, q in zip(a_logits, b_logits)) <= TOL
    assert ga.tokens == gb.tokens
    alone, alone_logits, g_alone, _ = run(())
    assert alone.stats.route == a.stats.route
    assert max(mx.abs(p - q).max().item() for p, q in zip(alone_logits, a_logits)) <= TOL
    assert g_alone.tokens == ga.tokens


@pytest.mark.parametrize("in_place", ["1", "0"])
def test_decode_never_dequantizes(tiny_model, monkeypatch, in_place):
    """Per decode step: no dequantize call at all, no SDPA; every layer reads all 8 rows'
    packed pages, through quantized_matmul on gathered pages or gather_qmm on the pages in
    place (CPU, engine.options.q_in_place) or the fused kernel (MLX CUDA)."""
    model, tok, spec = _model(tiny_model, "llama", 64)
    prompts, _ = _rows(seed=11, prompt_lens=(300, 280, 260, 240, 220, 200, 180, 160))
    per_step = []  # steps without a prefill pass: (decode rows, the calls of the step, pages in use)
    calls: tuple[list, list, list, list] = ([], [], [], [])

    class Counted(EngineHooks):
        def on_step(self, plan, times):
            if not plan.prefill:  # the first steps decode some rows while the others still prefill
                per_step.append((len(plan.decode), *[list(c) for c in calls], eng.stats()["pages_in_use"]))
            for c in calls:
                c.clear()

    # lookahead on for one case on the CPU too (the GPU's default): its last steps are decode steps as well
    options = EngineOptions(q_in_place=in_place == "1", lookahead="auto" if in_place == "1" else "on")
    eng = _engine(model, tok, spec, "q4", 16, hooks=Counted(), options=options)
    route = kv_cache(eng).attention  # the route under test
    fused = isinstance(route, cuda.CudaQuantRoute)
    assert bool(eng.lookahead) == (ON_CUDA or in_place == "0")
    assert fused == ON_CUDA and fused == (eng.stats()["route"] == ROUTE_CUDA_Q)
    assert route.in_place == (ON_CPU and in_place == "1")
    qmm_calls, sdpa_calls, raw_dequant, kernel_calls = calls
    real_qmm, real_sdpa, real_dq = mx.quantized_matmul, mx.fast.scaled_dot_product_attention, mx.dequantize
    real_gqmm = mx.gather_qmm
    real_kernel = cuda.paged_decode_attention_quantized

    def qmm(x, w, *a, **kw):
        qmm_calls.append((kw["transpose"], w.size))
        return real_qmm(x, w, *a, **kw)

    def gqmm(x, w, *a, **kw):  # in place: the packed elements of the pages its indices pick
        qmm_calls.append((kw["transpose"], kw["rhs_indices"].size * w.shape[-2] * w.shape[-1]))
        assert w.ndim == 3 and w.shape[0] == eng.stats()["pool_capacity_pages"] * spec.num_kv_heads  # the pool
        return real_gqmm(x, w, *a, **kw)

    def sdpa(*a, **kw):
        sdpa_calls.append(1)
        return real_sdpa(*a, **kw)

    def dq(*a, **kw):
        raw_dequant.append(1)
        return real_dq(*a, **kw)

    def kernel(q, pages, tails, table, pos, *a, **kw):
        # packed pool buffers (uint32 codes), the rows' sealed tokens (p - p % P) read through their page tables
        P = pages.tail_k.shape[2]
        kernel_calls.append((pages.packed[0].dtype, pages.packed[3].dtype, int((pos - pos % P).sum().item()),
                             table.shape))
        return real_kernel(q, pages, tails, table, pos, *a, **kw)

    monkeypatch.setattr(mx, "quantized_matmul", qmm)
    monkeypatch.setattr(mx, "gather_qmm", gqmm)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(mx, "dequantize", dq)  # every dequantize the engine makes goes through it
    monkeypatch.setattr(cuda, "paged_decode_attention_quantized", kernel)
    eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)])
    # every decode step, however many rows it ran (the lookahead's last ones, GPU default, may run
    # fewer or none), dequantizes nothing and runs no SDPA; a step without rows reads no pages
    assert per_step and all(not raw and not sdpa_n for _, _, sdpa_n, raw, _, _ in per_step)
    assert all(not qmm_sizes and not kernels for n, qmm_sizes, _, _, kernels, _ in per_step if n == 0)
    full = [s[1:] for s in per_step if s[0] == 8]  # steps of all 8 rows
    assert len(full) >= 15
    L = spec.num_layers
    for qmm_sizes, _, _, kernels, in_use in full:
        assert in_use >= 100  # many quantized pages held: 8 rows x 10+ pages
        if fused:  # one kernel call per layer, on the packed pages of all 8 rows (>= 160 sealed tokens each)
            assert not qmm_sizes and len(kernels) == L
            for kw_dtype, vw_dtype, sealed_tokens, table_shape in kernels:
                assert kw_dtype == vw_dtype == mx.uint32
                assert table_shape[0] == 8 and sealed_tokens >= 8 * 160
            continue
        assert not kernels
        # every layer reads all 8 rows' packed pages once for the scores and once for the values
        # (in one call, or split over several CPU streams): (B, Hkv, >= 160 tokens, D*bits/32)
        keys = sum(n for tr, n in qmm_sizes if tr)
        vals = sum(n for tr, n in qmm_sizes if not tr)
        assert keys == vals >= L * 8 * spec.num_kv_heads * 160 * spec.head_dim * 4 // 32
        assert L * 2 <= len(qmm_sizes) <= L * 2 * len(route.streams)
    # prefill (before the first decode step) did dequantize the sealed pages, once per chunk
    assert eng.summary()["route"] == expected_route(spec, "q4")


@cpu_only
@pytest.mark.parametrize("mode,in_place", [("q8", "1"), ("q8", "0"), ("q4", "1"), ("q4", "0"), ("none", "1")])
def test_attention_split_over_cpu_streams_is_bit_identical(tiny_model, monkeypatch, mode, in_place):
    """Decode attention spread over CPU streams (q8/q4 gathered: key scores by page runs, value
    sums by row and KV head; q8/q4 in place: both by page runs; kv none in place: groups of
    rows) gives exactly the logits of one stream."""
    model, tok, spec = _model(tiny_model, "llama", 64)
    prompts, forced = _rows(seed=13, prompt_lens=(600, 420, 9, 333), steps=(40, 40, 40, 40))
    calls = []
    real_qmm, real_gqmm, real_dense = mx.quantized_matmul, mx.gather_qmm, dense.paged_grouped_decode

    def qmm(*a, **kw):
        calls.append(kw.get("stream"))
        return real_qmm(*a, **kw)

    def gqmm(*a, **kw):
        calls.append(kw.get("stream"))
        return real_gqmm(*a, **kw)

    def in_place_dense(*a, **kw):
        calls.append(mx.default_stream(mx.cpu))
        return real_dense(*a, **kw)

    monkeypatch.setattr(mx, "quantized_matmul", qmm)
    monkeypatch.setattr(mx, "gather_qmm", gqmm)
    monkeypatch.setattr(dense, "paged_grouped_decode", in_place_dense)
    monkeypatch.setattr(cpu_streams, "MIN_WORK", 1 << 12)  # split even this tiny model's work
    logits = {}
    for n in (1, 3):
        del calls[:]
        eng = _engine(model, tok, spec, mode, 16, max_batch=4, chunk=256,
                      options=EngineOptions(q_in_place=in_place == "1", attention_threads=n))
        assert kv_cache(eng).attention.in_place == (in_place == "1")  # the route under test
        eng.generate(_requests(eng, prompts, forced))
        logits[n] = eng.hooks.logits
        assert len({str(s) for s in calls}) == n  # the work really ran on n streams
    for key, ls in logits[1].items():
        assert all(mx.array_equal(a, b).item() for a, b in zip(ls, logits[3][key])), key


def _scaled_fp16_model(tmp_path, scale: float):
    model, tok, spec = load_model(ModelConfig(source="tiny", cache_dir=str(tmp_path), dtype="float16", seed=5))
    for layer in model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            proj.weight = proj.weight * scale
    mx.eval(model.parameters())
    return model, tok, spec


def _layer0_qk(model, tokens):
    """Layer 0's RoPE'd fp16 queries/keys/values, as mlx-lm computes them."""
    attn = model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(mx.array([tokens])))
    B, L, _ = h.shape

    def heads(x, n):
        return x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)

    q = attn.rope(heads(attn.q_proj(h), attn.n_heads))
    k = attn.rope(heads(attn.k_proj(h), attn.n_kv_heads))
    v = heads(attn.v_proj(h), attn.n_kv_heads)
    return q, k, v, attn.scale


def test_fp16_huge_scores_stay_finite(tmp_path):
    model, tok, spec = _scaled_fp16_model(tmp_path, 1000.0)
    assert spec.dtype == "float16"
    prompts, _ = _rows(seed=5, prompt_lens=(40, 70, 23))
    # the scores really exceed fp16 range
    q, k, v, scale = _layer0_qk(model, prompts[1])
    k_rep = mx.repeat(k.astype(mx.float32), q.shape[1] // k.shape[1], axis=1)
    scores = (q.astype(mx.float32) * scale) @ k_rep.swapaxes(-1, -2)
    assert mx.abs(scores).max().item() > 2 * 65504
    if ON_CPU:  # the hazard is real there: MLX's CPU SDPA on these fp16 q/k overflows (its CUDA SDPA
        # kept this case finite on the H200; the engine must stay finite on every backend)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        assert not mx.isfinite(out).all().item()
    # the portable route too (Metal's; its q8/q4 are refused on MLX CUDA): its decode reads fp16 pages
    # in place only where the scores stay in range, so these take the float32 paths
    cases = [(mode, "auto") for mode in ("none", "q8", "q4")]
    cases += [] if ON_CUDA else [(mode, "portable") for mode in ("none", "q8", "q4")]
    for mode, opt in cases:
        route = expected_route(spec, mode, route=opt)
        eng = _engine(model, tok, spec, mode, 16, max_batch=4, options=EngineOptions(route=opt))
        eng.hooks.capture_logits.update(f"r{i}" for i in range(len(prompts)))
        results = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=40)) for i, p in enumerate(prompts)])
        for r in results:
            assert r.ok, (mode, r.error_code, r.error_message)
            lg = eng.hooks.logits[r.key]
            assert len(lg) == r.stats.output_tokens == 40  # crosses pages: sealed ones too
            assert all(mx.isfinite(x).all().item() for x in lg), mode
            assert r.stats.route == route
        assert eng.summary()["route"] == route


def test_route_reported_is_route_that_ran(tiny_model, tmp_path, monkeypatch):
    """float32 none -> paged_sdpa (SDPA in float32 because the model is); fp16 none ->
    paged_sdpa_f32 (SDPA on upcast q/k/v); q8 -> paged_qmm_f32 (quantized_matmul in decode).
    On MLX CUDA decode runs the fused kernels instead (paged_cuda_kernel for none,
    paged_cuda_qkernel for q8/q4, queries in the model dtype, float32 inside); prefill is
    attention composed of matmuls (dense.composed_attention, no cuDNN graph per pass shape), in float32."""
    seen = []
    real_qmm, real_sdpa = mx.quantized_matmul, mx.fast.scaled_dot_product_attention
    real_gqmm = mx.gather_qmm
    real_k, real_qk = cuda.paged_decode_attention, cuda.paged_decode_attention_quantized
    real_composed = dense.composed_attention

    def qmm(x, *a, **kw):
        seen.append(("qmm", x.dtype))
        return real_qmm(x, *a, **kw)

    def gqmm(x, *a, **kw):  # CPU float32 stores: the packed pages read in place
        seen.append(("qmm", x.dtype))
        return real_gqmm(x, *a, **kw)

    def sdpa(q, *a, **kw):
        seen.append(("sdpa", q.dtype))
        return real_sdpa(q, *a, **kw)

    def kernel(q, *a, **kw):
        seen.append(("kernel", q.dtype))
        return real_k(q, *a, **kw)

    def composed(q, *a, **kw):
        seen.append(("composed", q.dtype))
        return real_composed(q, *a, **kw)

    def qkernel(q, *a, **kw):
        seen.append(("qkernel", q.dtype))
        return real_qk(q, *a, **kw)

    monkeypatch.setattr(mx, "quantized_matmul", qmm)
    monkeypatch.setattr(mx, "gather_qmm", gqmm)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(cuda, "paged_decode_attention", kernel)
    monkeypatch.setattr(cuda, "paged_decode_attention_quantized", qkernel)
    monkeypatch.setattr(dense, "composed_attention", composed)
    f32 = _model(tiny_model, "llama", 64)
    f16 = _scaled_fp16_model(tmp_path, 1.0)
    prompt = list(range(40, 90))
    pre = ("composed" if ON_CUDA else "sdpa", mx.float32)
    if ON_CUDA:
        cases = ((f32, "none", ROUTE_CUDA, {pre, ("kernel", mx.float32)}),
                 (f16, "none", ROUTE_CUDA, {pre, ("kernel", mx.float16)}),
                 (f16, "q8", ROUTE_CUDA_Q, {pre, ("qkernel", mx.float16)}),
                 (f32, "q4", ROUTE_CUDA_Q, {pre, ("qkernel", mx.float32)}))
    else:
        cases = ((f32, "none", ROUTE_DENSE, {pre}),
                 (f16, "none", ROUTE_DENSE_F32, {pre}),
                 (f16, "q8", ROUTE_QMM, {pre, ("qmm", mx.float32)}),
                 (f32, "q4", ROUTE_QMM, {pre, ("qmm", mx.float32)}))
    for (model, tok, spec), mode, route, kinds in cases:
        assert expected_route(spec, mode) == route
        del seen[:]
        eng = _engine(model, tok, spec, mode, 16)
        (res,) = eng.generate([Request("a", prompt, SamplingParams(max_tokens=8))])
        assert res.ok and res.stats.route == eng.summary()["route"] == route
        assert set(seen) == kinds, (mode, spec.dtype, set(seen))


def test_gate_refuses_unvalidated_pairs(tiny_model):
    for overrides, group in (({"family": "qwen3", "head_dim": 64}, 64), ({"family": "llama", "head_dim": 96}, 32)):
        model, tok, spec = tiny_model(**overrides)
        assert (spec.family, spec.head_dim) not in VALIDATED
        with pytest.raises(KvbatchConfigError) as err:
            _engine(model, tok, spec, "q8", 16, group)
        msg = str(err.value)
        assert "\n" not in msg and "kv=q8 is not validated" in msg and str(spec.head_dim) in msg
        assert "kv.allow_unvalidated=true" in msg
        # kv=none needs no validation, and the override lets q8 run
        _engine(model, tok, spec, "none", 16)
        eng = _engine(model, tok, spec, "q8", 16, group, allow_unvalidated=True)
        (res,) = eng.generate([Request("a", list(range(60, 100)), SamplingParams(max_tokens=30))])
        assert res.ok and res.stats.output_tokens == 30 and res.stats.route == expected_route(spec, "q8", group)
    # a group size that does not divide the head size is refused even with the override
    model, tok, spec = tiny_model(family="llama", head_dim=96)
    with pytest.raises(KvbatchConfigError, match="group_size=64 does not fit head size 96"):
        _engine(model, tok, spec, "q8", 16, 64, allow_unvalidated=True)
