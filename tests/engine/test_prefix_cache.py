"""Shared prompt pages (issue 21): automatic prefix caching and n samples from one prefill.

The equivalence test follows test_batched_prefill's pattern: teacher-forced rows whose prompts share
0 tokens, part of a page, exactly k pages, or every full page, run with and without prefix caching
must give the same logits. q8/q4 prefill with chunks of one page, one row a pass, in both runs: a page
taken from the cache then holds exactly what the row would have computed (its chunk attended to the
sealed pages before it and to itself at full precision), so every mode is held to 1e-4. (In passes of
several rows a key can round one quantization step apart from the same key computed in another pass
shape, with or without the cache: test_batched_prefill's bound; kv none runs batched passes here.)
"""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.engine import Engine
from kvbatch.engine.errors import NON_FINITE_LOGITS, UnreservedWriteError
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.pages import CacheRow, PagePool
from kvbatch.engine.samples import derive_seed, samples
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config
from tests.conftest import kv_cache

STEPS = 4


def _engine(m, mode="none", page=16, prefix_cache=True, **kw):
    model, tok, spec = m
    cfg = engine_config(kv_mode=mode, page_size=page, **{"memory_budget": 2 << 30, **kw})
    cfg.engine.prefix_cache = prefix_cache
    return Engine(model, tok, spec, cfg)


def scheduler_under_test(eng):
    """The engine's scheduler, for the test that preempts a row at a chosen point (mid-prefill)."""
    return eng.scheduler


def _prompts(P: int) -> list[list[int]]:
    """r0 writes the shared pages; the others share with it 0 tokens, half a page, exactly two
    pages (then their own tokens), all of its prompt, and a prompt that is exactly its first two pages."""
    base = [(7 * j + 3) % 251 for j in range(2 * P + P // 2 + 5)]
    own = lambda i, n: [(13 * i + 5 * j + 1) % 241 for j in range(n)]  # noqa: E731
    return [base, own(1, 2 * P + 3), base[:P // 2] + own(2, P + 2), base[:2 * P] + own(3, 3), list(base),
            base[:2 * P]]


def _run(m, mode, page, prefix_cache, forced=True):
    quant = mode != "none"
    eng = _engine(m, mode, page, prefix_cache, prefill_chunk=page if quant else 512, max_batch=8,
                  prefill_tokens=1 if quant else "auto")
    prompts = _prompts(page)
    for i in range(len(prompts) if forced else 0):
        eng.hooks.force(f"r{i}", [(11 * i + 3 * j) % 256 for j in range(STEPS)])
    res = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=STEPS)) for i, p in enumerate(prompts)])
    assert all(r.ok for r in res)
    return {k: mx.stack(v) for k, v in eng.hooks.logits.items()}, res, eng


@pytest.mark.parametrize("mode", ["none", "q8", "q4"])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("family,head_dim", [("llama", 64), ("qwen3", 128)])
def test_prefix_cache_gives_the_same_logits(tiny_model, family, head_dim, mode, page):
    m = tiny_model(family=family, head_dim=head_dim)
    off, res_off, eng_off = _run(m, mode, page, prefix_cache=False)
    on, res_on, eng_on = _run(m, mode, page, prefix_cache=True)
    prompts = _prompts(page)
    # what each row took from the cache: r0 and r1 nothing, r2 half a page (never shared), r3 two pages,
    # r4 every full page before its last token, r5 (exactly two pages) the first: its last token is computed
    want = [0, 0, 0, 2 * page, (len(prompts[4]) - 1) // page * page, page]
    assert [r.stats.cached_tokens for r in res_on] == want
    assert [r.stats.cached_tokens for r in res_off] == [0] * 6
    s_on, s_off = eng_on.summary(), eng_off.summary()
    assert s_off["prefill_tokens_total"] == sum(map(len, prompts))
    assert s_on["prefill_tokens_total"] == sum(map(len, prompts)) - sum(want) == \
        s_off["prefill_tokens_total"] - s_on["prompt_tokens_cached"]
    for key, a in off.items():
        assert a.shape == on[key].shape == (STEPS, m[2].vocab_size)
        assert mx.abs(a - on[key]).max().item() <= 1e-4, key
    assert eng_on.cache.pool.in_use == 0 and eng_on.cache.pool.num_cached > 0


@pytest.mark.parametrize("mode", ["none", "q8", "q4"])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("family,head_dim", [("llama", 64), ("qwen3", 128)])
def test_greedy_tokens_identical_with_and_without_prefix_cache(tiny_model, family, head_dim, mode, page):
    m = tiny_model(family=family, head_dim=head_dim)
    _, off, _ = _run(m, mode, page, prefix_cache=False, forced=False)
    _, on, eng = _run(m, mode, page, prefix_cache=True, forced=False)
    assert [r.tokens for r in on] == [r.tokens for r in off] and all(len(r.tokens) == STEPS for r in on)
    assert eng.summary()["prompt_tokens_cached"] > 0


def test_shared_system_prompt_is_prefilled_once(tiny_model):
    """8 rows behind one 200-token system prompt: the shared 12 pages are computed once and held once."""
    P, system, rows, steps = 16, 200, 8, 4
    head = [(5 * j + 2) % 250 for j in range(system)]
    prompts = [head + [(17 * i + j) % 240 for j in range(10)] for i in range(rows)]
    got = {}
    for pc in (False, True):
        eng = _engine(tiny_model(), page=P, prefix_cache=pc, max_batch=rows)
        res = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=steps)) for i, p in enumerate(prompts)])
        got[pc] = (res, eng.summary())
    shared = system // P  # 12 full pages every prompt begins with
    own_tokens = len(prompts[0]) - shared * P  # 18: the rest of each prompt, computed by each row
    res, s = got[True]
    assert s["prefill_tokens_total"] == len(prompts[0]) + (rows - 1) * own_tokens
    assert s["prompt_tokens_cached"] == (rows - 1) * shared * P == sum(r.stats.cached_tokens for r in res)
    own_pages = -(-(own_tokens + steps - 1) // P)  # each row's own pages: its prompt's rest and its tokens
    assert s["peak_pages_in_use"] == shared + rows * own_pages
    assert got[False][1]["peak_pages_in_use"] > 2 * s["peak_pages_in_use"]  # a copy of the 12 pages per row
    assert [r.tokens for r in res] == [r.tokens for r in got[False][0]]


def _sampled(m, n, temperature, seed=0, prefix_cache=True):
    eng = _engine(m, prefix_cache=prefix_cache)
    prompt = [(3 * j + 1) % 250 for j in range(40)]  # 2 full pages and a part of a third
    req = Request("row", prompt, SamplingParams(max_tokens=16, temperature=temperature, seed=seed))
    res = eng.generate(samples(req, n))
    assert all(r.ok and len(r.tokens) for r in res)
    return res, eng.summary()


@pytest.mark.parametrize("prefix_cache", [True, False])  # forks share pages by reference count either way
def test_n_samples_from_one_prefill(tiny_model, prefix_cache):
    m = tiny_model()
    res, s = _sampled(m, 4, 1.0, prefix_cache=prefix_cache)
    assert [r.key for r in res] == [f"row#s{i}" for i in range(4)]
    assert len({tuple(r.tokens) for r in res}) == 4  # each sample its own random stream
    assert s["prefill_tokens_total"] == 40 and s["forks"] == 3  # the prompt once, the partial page copied
    assert [r.stats.cached_tokens for r in res] == [0, 40, 40, 40]
    again, _ = _sampled(m, 4, 1.0, prefix_cache=prefix_cache)
    assert [r.tokens for r in again] == [r.tokens for r in res]  # the same job: the same 4 outputs
    greedy, _ = _sampled(m, 4, 0.0, prefix_cache=prefix_cache)
    one, _ = _sampled(m, 1, 0.0, prefix_cache=prefix_cache)
    assert all(r.tokens == one[0].tokens for r in greedy)


def test_samples_admitted_after_their_first_take_its_cached_pages_side_by_side(tiny_model):
    """Samples of a prompt admitted after its first has finished (no slot was free for a fork) find
    its full pages cached: the first of them computes only its last page, and the others are admitted
    beside it, taking the same cached pages, instead of waiting for it to fork them."""
    eng = _engine(tiny_model(), max_batch=4)
    prompt = [(3 * j + 1) % 250 for j in range(40)]  # 2 full pages and a part of a third
    res = eng.generate(samples(Request("row", prompt, SamplingParams(max_tokens=8)), 6))
    assert all(r.ok for r in res) and len({tuple(r.tokens) for r in res}) == 1  # greedy: one output
    assert [r.stats.cached_tokens for r in res] == [0, 40, 40, 40, 32, 32]  # s4, s5: cached pages, own last page
    s = eng.summary()
    assert s["forks"] == 3 and s["prefill_tokens_total"] == 40 + 2 * 8


def test_sample_seeds():
    req = Request("k", [1, 2], SamplingParams(seed=7))
    got = samples(req, 3)
    assert [r.sampling.seed for r in got] == [7, derive_seed(7, "k#s1"), derive_seed(7, "k#s2")]
    assert len({r.sampling.seed for r in got}) == 3 and all(r.group == "k" for r in got)
    assert samples(req, 1) == [req]
    assert derive_seed(0, "a") == derive_seed(0, "a") != derive_seed(1, "a")
    assert 0 <= derive_seed(2**63 - 1, "x") < 2**63


@pytest.mark.parametrize("admission", ["reserve", "optimistic"])
def test_pool_under_pressure_evicts_cached_pages_first(tiny_model, admission):
    """A pool with room for two rows: rows that finish leave their pages cached, and the rows after them
    (other prompts) evict those pages, oldest first, rather than wait, grow, be refused or preempted."""
    m = tiny_model()
    P, steps, rows = 16, 20, 8
    prompts = [[(19 * i + 3 * j) % 250 for j in range(40)] for i in range(rows)]
    probe = _engine(m, page=P, max_batch=2)
    budget = probe.memory.bytes_for([40 + steps] * 2, 40)
    ref = [r.tokens for r in _engine(m, page=P, max_batch=2, prefix_cache=False).generate(
        [Request(f"r{i}", p, SamplingParams(max_tokens=steps)) for i, p in enumerate(prompts)])]
    eng = _engine(m, page=P, max_batch=2, memory_budget=budget, admission=admission)
    res = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=steps)) for i, p in enumerate(prompts)])
    s = eng.summary()
    assert all(r.ok for r in res) and [r.tokens for r in res] == ref
    assert s["page_evictions"] > 0 and s["preemptions"] == 0
    assert s["weights_bytes"] + s["peak_capacity_pages"] * s["page_bytes"] <= budget
    assert s["pages_evictable"] > 0  # the last rows' pages, still cached


def test_page_pool_refcounts_and_lru():
    pool = PagePool()
    pool.add_pages(4)
    a = pool.allocate(2)
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    pool.share(a)  # a second holder of both
    assert (pool.in_use, pool.refs, pool.shared) == (2, 4, 2)
    pool.free(a)
    assert pool.in_use == 2 and pool.num_evictable == 0  # still held once
    pool.free(a)
    assert pool.in_use == 0 and pool.num_evictable == 2 and pool.num_free == 4
    assert pool.cached(b"h0") == a[0]
    pool.allocate(2)  # the never-cached pages go first
    assert pool.evictions == 0 and pool.num_cached == 2
    (p,) = pool.allocate(1)  # then the oldest cached page: the row's last page was queued first
    assert p == a[1] and pool.evictions == 1 and pool.cached(b"h1") is None and pool.cached(b"h0") == a[0]
    pool.share([a[0]])  # a cached page nobody held is taken back from the queue
    assert pool.num_evictable == 0 and pool.ref(a[0]) == 1
    with pytest.raises(RuntimeError):
        pool.free([p, p])


def test_a_pass_never_writes_into_a_shared_page(tiny_model):
    eng = _engine(tiny_model(), page=16)
    c = kv_cache(eng)  # the cache's own pass check, driven directly
    a, b = CacheRow("a"), CacheRow("b")
    c.reserve(a, 20, 1 << 30)
    c.begin([a], 20)
    c.end()
    c.fork(a, b, 1 << 30)  # b shares a's first page, its second (partly filled) is b's own copy
    assert b.pages[0] == a.pages[0] and b.pages[1] != a.pages[1] and b.length == 20
    b.length = 10  # as if b were to write inside the shared page
    c.reserve(b, 1, 1 << 30)
    with pytest.raises(UnreservedWriteError, match=f"row b: a write into page {b.pages[0]}, which is shared"):
        c.begin([b], 1)
    c.reserve(a, 1, 1 << 30)  # in a pass of several rows the check names the row that writes the page
    with pytest.raises(UnreservedWriteError, match=f"row b: a write into page {b.pages[0]}, which is shared"):
        c.begin([a, b], 1)


def test_prompt_logprobs_rows_compute_their_prompt(tiny_model):
    """A row that scores its prompt (prompt_logprobs) never takes cached pages (every prompt position must
    be computed, as in vLLM); its samples forked from it copy its prompt's scores."""
    m = tiny_model()
    head = [(5 * j + 2) % 250 for j in range(50)]
    plain = SamplingParams(max_tokens=3)
    scored = SamplingParams(max_tokens=3, prompt_logprobs=True, temperature=1.0)
    reqs = [Request("a", head + [1, 2, 3], plain), *samples(Request("b", head + [4, 5], scored), 2)]
    res = _engine(m).generate(reqs)
    alone = _engine(m, prefix_cache=False).generate([Request("b", head + [4, 5], scored)])[0]
    assert [r.stats.cached_tokens for r in res] == [0, 0, 52]  # b#s0 computed all of it; b#s1 is its fork
    for r in res[1:]:
        assert len(r.logprobs.prompt) == 51
        assert max(abs(x - y) for x, y in zip(r.logprobs.prompt, alone.logprobs.prompt)) <= 1e-4


@pytest.mark.parametrize("mode", ["none", "q8"])
def test_a_row_preempted_mid_prefill_publishes_no_unchecked_page(tiny_model, mode):
    """Row a's prefill is poisoned (NaN attention) and it is preempted after its first chunk: no logits
    have checked that chunk's pages, so none may be cached. Row b, with the same prompt, then computes
    its own pages and ends as it does alone; a, readmitted, ends with its error."""
    m = tiny_model()
    P = 16
    prompt = [(7 * j + 3) % 250 for j in range(3 * P + 5)]
    ref = _engine(m, mode, P).generate([Request("b", prompt, SamplingParams(max_tokens=6))])[0]
    model, tok, spec = m
    plans = []

    class Plans(EngineHooks):
        def on_step(self, plan, times):
            plans.append(plan)

    eng = Engine(model, tok, spec, engine_config(kv_mode=mode, page_size=P, prefill_chunk=P, prefill_tokens=P,
                                                 memory_budget=2 << 30), Plans(nonfinite=("a", 0)))
    eng.add(Request("a", prompt, SamplingParams(max_tokens=6)))
    eng.step()  # a's first chunk: one full page stored, its K/V NaN past layer 0
    ((a, n),) = plans[0].prefill
    assert a.req.key == "a" and n == P and a.prefilling and a.kv.length == P
    assert (eng.stats()["rows_running"], eng.stats()["pages_in_use"]) == (1, 1)
    scheduler_under_test(eng).preempt(a)
    s = eng.stats()
    assert s["pages_cached"] == 0 and s["pages_in_use"] == 0 and s["rows_waiting"] == 1
    eng.add(Request("b", prompt, SamplingParams(max_tokens=6)))
    res = {r.key: r for r in eng.run()}
    assert res["b"].ok and res["b"].tokens == ref.tokens
    assert res["a"].error_code == NON_FINITE_LOGITS and res["a"].tokens == []
