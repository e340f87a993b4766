"""The growable paged KV cache with continuous batching (issue 3), on tiny random models.

Every comparison is against mlx-lm's own single-stream path (`generate_step` over a
plain `KVCache`) on the same prompt: the paged, batched engine must give the same
logits (within 1e-4) and the same greedy tokens.
"""
from __future__ import annotations

import math

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, mamba

from kvbatch.engine.backend import on_cpu
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.kv.routes.portable import PortableDenseRoute
from kvbatch.engine.kv.routes.select import select_route
from kvbatch.engine.engine import Engine
from kvbatch.engine.testing import engine_config
from kvbatch.engine.errors import INVALID_INPUT, PROMPT_TOO_LONG, KvbatchConfigError, UnreservedWriteError
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.memory import kv_layout
from kvbatch.engine.models.spec import model_spec
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from tests.conftest import expected_route

BUDGET = 2 << 30
EOS = 257  # the tiny model's <|im_end|>


def mlx_lm_reference(model, prompt: list[int], n: int) -> tuple[list[int], list[mx.array]]:
    """Greedy tokens and the raw float32 logits of every step from mlx-lm's generate_step
    (single stream, plain KVCache). The logits come through a pass-through logits processor."""
    logits = []

    def keep(tokens, lg):
        logits.append(lg[0].astype(mx.float32))
        return lg

    tokens = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=[keep])]
    mx.eval(logits)
    return tokens, logits[:n]


def until_eos(tokens: list[int], stop_ids=(EOS,)) -> list[int]:
    """What the engine must return for a greedy row: mlx-lm's tokens up to the first stop id."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i]
    return tokens


def prompts_of(lengths: list[int], salt: int = 0) -> list[list[int]]:
    return [[(31 * i + 7 * j + salt) % 256 for j in range(n)] for i, n in enumerate(lengths)]


def make_engine(m, **cfg) -> Engine:
    model, tok, spec = m
    return Engine(model, tok, spec, engine_config(memory_budget=BUDGET, **cfg))


def pool_is_empty(eng: Engine) -> None:
    s = eng.summary()
    assert s["pages_in_use"] == 0
    assert s["pages_free"] == s["pool_capacity_pages"]


# ---- (a) teacher-forced logits against mlx-lm, batch of 8, small pages, pool growth ---------
@pytest.mark.parametrize("geometry", [dict(family="llama", head_dim=64),
                                      dict(family="qwen3", head_dim=128)], ids=["llama64", "qwen3_128"])
@pytest.mark.parametrize("P,route", [(4, "auto"), (16, "auto"), (16, "portable")],
                         ids=["page4", "page16", "page16-portable"])  # page16: CPU decode reads pages in place
def test_teacher_forced_logits_match_mlx_lm(tiny_model, geometry, P, route):
    """route=portable (what Apple's Metal backend runs: decode reads the pages in place with gather_mm,
    prefill gathers them for MLX's SDPA; no CPU-only kernels, no CUDA kernel) against the same
    reference, on every backend."""
    m = tiny_model(**geometry)
    model, _, spec = m
    steps = 300
    lengths = [3, 17, 9, 40, 1, 26, 12, 33]  # every row crosses many pages, prefill crosses chunks
    prompts = prompts_of(lengths)
    refs = [mlx_lm_reference(model, p, steps) for p in prompts]

    opts = EngineOptions(route=route)
    eng = make_engine(m, page_size=P, max_batch=8, prefill_chunk=5, options=opts)
    assert spec.dtype == "float32" and eng.summary()["route"] == expected_route(spec, "none", route=route)
    # the route the engine's cache selects (kv/routes/select.py, its one place), for this layout and options
    _, attention = select_route(kv_layout(spec, "none", P, 64), spec.num_layers, mx.float32, 8, False,
                                spec.num_heads, opts)
    assert attention.in_place == (P >= 16 and on_cpu() and route == "auto")
    if route == "portable":
        assert type(attention) is PortableDenseRoute and not attention.grouped
        assert eng.summary()["route"] == "paged_sdpa"
    for i in range(len(prompts)):
        eng.hooks.force(f"r{i}", refs[i][0])
    results = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=steps)) for i, p in enumerate(prompts)])
    page_bytes = eng.summary()["page_bytes"]
    assert page_bytes == kv_layout(spec, "none", P, 64).page_bytes

    for res, p, (ref_tokens, ref_logits) in zip(results, prompts, refs):
        assert res.ok and res.finish_reason == "length", (res.key, res.error_code, res.error_message)
        assert res.tokens == ref_tokens
        logits = eng.hooks.logits[res.key]
        assert len(logits) == len(ref_logits) == steps
        diffs = [float(mx.abs(a - b).max()) for a, b in zip(logits, ref_logits)]
        assert max(diffs) <= 1e-4, (res.key, max(diffs), diffs.index(max(diffs)))
        # the row held whole pages for what it stored (prompt + every output token but the last)
        stored = len(p) + steps - 1
        assert res.stats.peak_kv_bytes == math.ceil(stored / P) * page_bytes
        assert res.stats.prompt_tokens == len(p) and res.stats.output_tokens == steps

    s = eng.summary()
    assert s["peak_concurrency"] == 8
    assert len(s["growth_events"]) >= 3
    # rows prefill in ragged passes of 5-token chunks, so they reach their length at different steps
    assert s["peak_pages_in_use"] <= sum(math.ceil((n + steps - 1) / P) for n in lengths)
    pool_is_empty(eng)


# ---- (b) page sizes 1, 16 and 256 -------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_page_sizes_greedy_tokens_equal_mlx_lm(tiny_model, page_size):
    m = tiny_model()
    model = m[0]
    n = 40
    prompts = prompts_of([5, 250, 23], salt=3)  # 250 + 40 crosses a 256-token page
    expected = [until_eos(mlx_lm_reference(model, p, n)[0]) for p in prompts]
    eng = make_engine(m, page_size=page_size, max_batch=4, prefill_chunk=64)
    results = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=n)) for i, p in enumerate(prompts)])
    assert [r.tokens for r in results] == expected
    assert all(r.ok for r in results)
    assert eng.summary()["page_size"] == page_size
    pool_is_empty(eng)


# ---- (c) continuous batching --------------------------------------------------------------
def test_continuous_batching_refills_finished_slots(tiny_model):
    m = tiny_model()
    model = m[0]
    max_tokens = [4, 50, 45, 60, 6, 5, 30, 8, 3, 20, 7, 12]  # 12 rows, 4 slots
    prompts = prompts_of([4 + (5 * i) % 19 for i in range(len(max_tokens))], salt=11)
    expected = [until_eos(mlx_lm_reference(model, p, n)[0]) for p, n in zip(prompts, max_tokens)]

    class Rows(EngineHooks):
        """Which rows run (started, not yet finished), which are past their prompt, each step's plan."""

        def __init__(self):
            super().__init__()
            self.started, self.prompt_done, self.plan = set(), set(), None

        def on_row_start(self, key):
            self.started.add(key)

        def on_prefill_chunk(self, key, done, total):
            if done == total:
                self.prompt_done.add(key)

        def on_step(self, plan, times):
            self.plan = plan

    hooks = Rows()
    eng = Engine(m[0], m[1], m[2], engine_config(memory_budget=BUDGET, page_size=8, max_batch=4, prefill_chunk=16),
                 hooks)
    passes = []  # (rows in the decode pass, rows running, rows still prefilling, rows still waiting)
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        eng.add(Request(f"r{i}", p, SamplingParams(max_tokens=n)))
    order, finished = [], set()
    while eng.has_unfinished():
        done = eng.step()
        order += done
        decoded = {r.req.key for r in hooks.plan.decode}
        # the rows running when the decode pass ran: those still running now, and those it ended
        ended = {r.key for r in done}
        running = hooks.started - finished - (ended - decoded)
        finished |= ended
        s = eng.stats()
        assert s["rows_running"] == len(hooks.started - finished)
        if decoded:
            passes.append((len(decoded), len(running), len(running - hooks.prompt_done), s["rows_waiting"]))
            assert decoded <= running & hooks.prompt_done  # only rows past their prompt decode

    by_key = {r.key: r for r in order}
    assert len(by_key) == len(prompts)
    for i, exp in enumerate(expected):
        r = by_key[f"r{i}"]
        assert r.ok and r.tokens == exp, (r.key, r.error_code)
        assert r.finish_reason == ("length" if len(exp) == max_tokens[i] else "stop")
    s = eng.summary()
    assert s["peak_concurrency"] == 4
    assert max(n for n, *_ in passes) == 4
    # while rows were waiting, every slot was taken (a finished row's slot was refilled at once) and
    # every running row past its prompt was in the decode pass
    assert all(running == 4 and n == running - prefilling for n, running, prefilling, waiting in passes if waiting)
    # results stream out as rows finish: short rows admitted late finish before the long first ones
    keys = [r.key for r in order]
    assert keys.index("r4") < keys.index("r1") and keys.index("r5") < keys.index("r3")
    pool_is_empty(eng)


# ---- (d) writes past the reservation raise ------------------------------------------------
@pytest.mark.parametrize("kv_mode", ["none", "q8"])
def test_write_past_reserved_capacity_raises(tiny_model, kv_mode):
    _, _, spec = tiny_model()
    P = 4
    layout = kv_layout(spec, kv_mode, P, 64)
    cache = PagedKVCache(layout, spec.num_layers, mx.float32, tail_slots=2, upcast=False)
    row = CacheRow("a")
    cache.admit(row)
    cache.reserve(row, 5, BUDGET)
    assert row.reserved == 5 and len(row.pages) == 2

    with pytest.raises(UnreservedWriteError):  # a pass of 6 tokens when 5 were reserved
        cache.begin([row], 6)
    assert cache.plan is None and row.length == 0

    def kv(L):
        shape = (1, spec.num_kv_heads, L, spec.head_dim)
        return mx.ones(shape), mx.ones(shape)

    before = [mx.array(a) for a in cache.store.all_arrays()]
    cache.begin([row], 3)
    with pytest.raises(UnreservedWriteError):  # the model writes more tokens than the pass reserved
        cache.views[0].update_and_fetch(*kv(4))
    with pytest.raises(UnreservedWriteError):  # or more rows
        k, v = kv(3)
        cache.views[0].update_and_fetch(mx.concatenate([k, k]), mx.concatenate([v, v]))
    for a, b in zip(before, cache.store.all_arrays()):
        assert mx.array_equal(a, b).item(), "a refused write changed the buffers"
    cache.views[0].update_and_fetch(*kv(3))  # the reserved write itself is fine
    cache.end()
    assert row.length == 3

    with pytest.raises(UnreservedWriteError):  # 3 stored + 3 more > 5 reserved
        cache.begin([row], 3)
    with pytest.raises(UnreservedWriteError):  # no pass at all
        cache.views[1].update_and_fetch(*kv(1))
    cache.reserve(row, 3, BUDGET)
    cache.begin([row], 3)  # now it is reserved
    cache.end()
    cache.release(row)
    assert cache.pool.in_use == 0


def test_growth_doubles_but_stops_at_the_running_rows_worst_case(tiny_model):
    """Geometric growth never allocates past what the running rows can ever hold (want_pages)."""
    _, _, spec = tiny_model()
    layout = kv_layout(spec, "none", 4, 64)
    grown = {}
    for want in (0, 10):
        cache = PagedKVCache(layout, spec.num_layers, mx.float32, tail_slots=2, upcast=False)
        row = CacheRow("a")
        cache.reserve(row, 8 * 4, BUDGET, want)
        row.length = 8 * 4
        cache.reserve(row, 1, BUDGET, want)  # a 9th page
        grown[want] = [(e["from_pages"], e["to_pages"]) for e in cache.growth_events]
        assert cache.capacity_pages == cache.pool.capacity and len(row.pages) == 9
    assert grown[0] == [(0, 8), (8, 16)]  # uncapped: doubles
    assert grown[10] == [(0, 8), (8, 10)]  # capped at the worst case


# ---- (e) freed pages are reused: no growth when they suffice -----------------------------
def test_pool_reuses_freed_pages_without_growing(tiny_model):
    m = tiny_model()
    prompts = prompts_of([21] * 5, salt=5)
    req = lambda i: Request(f"r{i}", prompts[i], SamplingParams(max_tokens=30))  # noqa: E731

    alone = make_engine(m, page_size=4, max_batch=1, prefill_chunk=8)
    alone.generate([req(0)])
    one_row_growth = alone.summary()["growth_events"]
    assert len(one_row_growth) >= 3

    eng = make_engine(m, page_size=4, max_batch=1, prefill_chunk=8)
    for i in range(5):
        eng.add(req(i))
    caps = []
    for res in eng.run():
        assert res.ok
        caps.append(eng.summary()["pool_capacity_pages"])
        pool_is_empty(eng)  # the finished row gave back every page at once
    s = eng.summary()
    assert len(caps) == 5 and len(set(caps)) == 1  # capacity never moved after the first row
    assert [(g["from_pages"], g["to_pages"]) for g in s["growth_events"]] == \
        [(g["from_pages"], g["to_pages"]) for g in one_row_growth]
    assert s["peak_pages_in_use"] == math.ceil((21 + 30 - 1) / 4)
    pool_is_empty(eng)


# ---- (f) growth events and peak capacity in the run stats -------------------------------
def test_summary_reports_growth_and_peak_capacity(tiny_model):
    m = tiny_model()
    P = 8
    eng = make_engine(m, page_size=P, max_batch=8, prefill_chunk=32)
    eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=64))
                  for i, p in enumerate(prompts_of([10, 70, 30, 5, 50, 20], salt=9))])
    s = eng.summary()
    ev = s["growth_events"]
    assert len(ev) >= 3
    assert ev[0]["from_pages"] == 0
    for a, b in zip(ev, ev[1:]):
        assert b["from_pages"] == a["to_pages"] > a["from_pages"]
    assert s["page_bytes"] == kv_layout(m[2], "none", P, 64).page_bytes
    assert all(e["bytes"] == e["to_pages"] * s["page_bytes"] for e in ev)
    assert s["pool_capacity_pages"] == s["peak_capacity_pages"] == ev[-1]["to_pages"]
    assert s["pool_bytes"] == s["pool_capacity_pages"] * s["page_bytes"]
    assert s["peak_pages_in_use"] <= s["peak_capacity_pages"]
    # growth stops at the rows' worst case (prompt + max_tokens each), never doubling past it
    assert s["peak_capacity_pages"] <= sum(math.ceil((n + 64) / P) for n in [10, 70, 30, 5, 50, 20])
    # the live buffers (pool_bytes: their own nbytes) agree with what summary says: K and V of every layer
    spec = m[2]
    assert spec.dtype == "float32"
    per_page = 2 * len(spec.kv_layers) * P * spec.num_kv_heads * spec.head_dim * 4
    assert s["pool_bytes"] == s["pool_capacity_pages"] * per_page
    pool_is_empty(eng)


# ---- (g) per-row errors never crash the batch ---------------------------------------------
def test_bad_rows_end_with_their_code_and_others_complete(tiny_model):
    m = tiny_model(context_length=64)
    model = m[0]
    good = prompts_of([7, 20], salt=2)
    expected = [until_eos(mlx_lm_reference(model, p, 16)[0]) for p in good]
    eng = make_engine(m, page_size=4, max_batch=8, prefill_chunk=16)
    results = eng.generate([
        Request("empty", [], SamplingParams(max_tokens=16)),
        Request("g0", good[0], SamplingParams(max_tokens=16)),
        Request("too_long", list(range(64)), SamplingParams(max_tokens=16)),
        Request("way_too_long", [1] * 500, SamplingParams(max_tokens=16)),
        Request("g1", good[1], SamplingParams(max_tokens=16)),
        Request("near_context", [5] * 60, SamplingParams(max_tokens=16)),
    ])
    by = {r.key: r for r in results}
    assert (by["empty"].finish_reason, by["empty"].error_code) == ("error", INVALID_INPUT)
    for k in ("too_long", "way_too_long"):
        assert (by[k].finish_reason, by[k].error_code) == ("error", PROMPT_TOO_LONG), by[k]
        assert by[k].tokens == []
    assert by["g0"].ok and by["g0"].tokens == expected[0]
    assert by["g1"].ok and by["g1"].tokens == expected[1]
    # a row that reaches the model's context stops there with "length"
    assert by["near_context"].ok and by["near_context"].finish_reason in ("length", "stop")
    assert 60 + len(by["near_context"].tokens) <= 64
    assert eng.summary()["rows_by_error_code"] == {"ok": 3, INVALID_INPUT: 1, PROMPT_TOO_LONG: 2}
    pool_is_empty(eng)


# ---- (h) sampling ---------------------------------------------------------------------------
def test_seeded_sampling_does_not_depend_on_batch(tiny_model):
    m = tiny_model()
    p = prompts_of([12], salt=4)[0]
    hot = SamplingParams(max_tokens=40, temperature=0.8, seed=7)

    alone = make_engine(m, page_size=4, max_batch=4).generate([Request("x", p, hot)])[0]
    others = prompts_of([30, 3, 17], salt=8)
    batch = make_engine(m, page_size=4, max_batch=4).generate([
        Request("o0", others[0], SamplingParams(max_tokens=25, temperature=0.8, seed=1)),
        Request("x", p, hot),
        Request("o1", others[1], SamplingParams(max_tokens=40)),
        Request("o2", others[2], SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3)),
    ])[1]
    assert alone.ok and batch.ok
    assert alone.tokens == batch.tokens
    assert len(alone.tokens) == 40 or alone.finish_reason == "stop"
    greedy = until_eos(mlx_lm_reference(m[0], p, 40)[0])
    other_seed = make_engine(m, page_size=4).generate(
        [Request("x", p, SamplingParams(max_tokens=40, temperature=0.8, seed=8))])[0]
    assert alone.tokens != greedy and alone.tokens != other_seed.tokens  # it really samples


def _row_with_printable_token(model, tok, n):
    """A prompt whose greedy output has, at position >= 2, the first occurrence of a printable
    ASCII token (so it can serve both as a stop id and as a stop string)."""
    for salt in range(40):
        p = prompts_of([9], salt=salt)[0]
        out = until_eos(mlx_lm_reference(model, p, n)[0])
        for j in range(2, len(out)):
            if 33 <= out[j] < 127 and out[j] not in out[:j] and chr(out[j]) not in tok.decode(out[:j]):
                return p, out, j
    pytest.fail("no prompt found with a printable greedy token")


def test_stop_ids_stop_strings_and_max_tokens(tiny_model):
    m = tiny_model()
    model, tok, _ = m
    p, out, j = _row_with_printable_token(model, tok, 40)
    stop_char = chr(out[j])
    eng = make_engine(m, page_size=4, max_batch=4)
    by = {r.key: r for r in eng.generate([
        Request("ids", p, SamplingParams(max_tokens=40, stop_token_ids=(out[j],))),
        Request("str", p, SamplingParams(max_tokens=40, stop=(stop_char,))),
        Request("len", p, SamplingParams(max_tokens=j)),
    ])}
    assert by["ids"].finish_reason == "stop" and by["ids"].tokens == out[:j]
    assert by["str"].finish_reason == "stop" and by["str"].tokens == out[:j + 1]
    assert by["str"].text == tok.decode(out[:j]) and stop_char not in by["str"].text
    assert by["len"].finish_reason == "length" and by["len"].tokens == out[:j]
    assert all(r.ok for r in by.values())
    pool_is_empty(eng)


# ---- (i) models the paged cache cannot serve are refused at construction ------------------
def _tiny_tok(m):
    return m[1]


def test_sliding_window_model_refused_at_construction(tiny_model):
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=300,
                  rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=10000.0,
                  layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    spec = model_spec("swa", model, config)
    with pytest.raises(KvbatchConfigError) as e:
        Engine(model, _tiny_tok(tiny_model()), spec, engine_config(memory_budget=BUDGET))
    msg = str(e.value)
    assert "\n" not in msg and "'llama'" in msg and "sliding" in msg


def test_recurrent_model_refused_at_construction(tiny_model):
    config = dict(model_type="mamba", vocab_size=300, hidden_size=32, intermediate_size=64, state_size=8,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4)
    model = mamba.Model(mamba.ModelArgs.from_dict(config))
    spec = model_spec("ssm", model, config)
    with pytest.raises(KvbatchConfigError) as e:
        Engine(model, _tiny_tok(tiny_model()), spec, engine_config(memory_budget=BUDGET))
    msg = str(e.value)
    assert "\n" not in msg and "'mamba'" in msg
