"""Memory budget with a pre-allocation check (issue 6), on tiny random models.

- a row that can never fit the budget ends `insufficient_memory` before any page is
  allocated for it; the others complete;
- a budget that fits two rows at a time runs eight rows two at a time;
- predicted KV bytes against the live buffers (MLX's own allocator count) for none/q8/q4;
- sizes and budgets (`auto` on the CPU), the start-up plan line;
- pool growth refused by the live free-memory check or by the budget: the row whose
  growth was refused ends `insufficient_memory`, nothing else moves.
"""
from __future__ import annotations

import math
import re

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import psutil
import pytest

import kvbatch.engine.kv.cache as kv_cache_mod
import kvbatch.engine.memory as memory_mod
from kvbatch.engine.engine import Engine
from kvbatch.engine.testing import engine_config
from kvbatch.engine.errors import INSUFFICIENT_MEMORY, RowError
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.batch_limits import resolve_prefill_tokens
from kvbatch.engine.memory import MemoryModel, format_plan, kv_layout, resolve_budget
from kvbatch.engine.sizes import parse_size
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from tests.conftest import PlanRecorder, cpu_only

BIG = 2 << 30


def active_memory() -> int:
    """MLX's active bytes once the device has finished: MLX CUDA frees a temporary (e.g. the
    zero pad of a pool growth) only when the GPU work that used it completes, so without the
    wait the last layer's pad still counts (seen: +786,432 B, one layer's V buffer, on the H200)."""
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


class NoEos:
    """The tiny tokenizer with EOS switched off: every row runs to max_tokens."""

    eos_token_ids: list[int] = []

    def __init__(self, tok):
        self._tok = tok

    def decode(self, tokens):
        return self._tok.decode(tokens)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * salt + 13 * j + 5) % 256 for j in range(n)]


def make_engine(m, budget, hooks=None, **cfg) -> Engine:
    model, tok, spec = m
    return Engine(model, NoEos(tok), spec, engine_config(memory_budget=budget, **cfg), hooks)


def memory_model(spec, mode="none", page_size=16, group_size=64, prefill_chunk=512, max_batch=8) -> MemoryModel:
    """The engine's memory model for a config, before any engine exists (budget 0: pricing only)."""
    return MemoryModel(spec, kv_layout(spec, mode, page_size, group_size), 0, prefill_chunk, max_batch,
                       resolve_prefill_tokens("auto", prefill_chunk))


def all_pages_free(eng) -> None:
    s = eng.stats()
    assert s["pages_in_use"] == 0 and s["pages_free"] == s["pool_capacity_pages"]


# ---- a row too big for the budget ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["none", "q8"])
def test_row_that_can_never_fit_is_refused_before_any_page(tiny_model, mode):
    m = tiny_model()
    spec = m[2]
    P, small, big_max = 8, 20, 1900
    mm = memory_model(spec, mode, page_size=P, max_batch=4)
    budget = mm.bytes_for([10 + small] * 3, 10)  # three small rows at once, no more
    assert mm.bytes_for([10 + big_max], 10) > budget  # the big row cannot fit even alone

    hooks = PlanRecorder()
    eng = make_engine(m, budget, hooks, kv_mode=mode, page_size=P, max_batch=4)
    keys = ["a", "big", "b", "c"]
    for i, k in enumerate(keys):
        eng.add(Request(k, prompt(10, i), SamplingParams(max_tokens=big_max if k == "big" else small)))
    res = {r.key: r for r in eng.run()}
    assert hooks.keys("refused") == ["big"]
    big_kv = next(r.row.kv for p in hooks.plans for r in p.refused)

    bad = res["big"]
    assert (bad.finish_reason, bad.error_code) == ("error", INSUFFICIENT_MEMORY)
    assert re.search(r"needs \d+ bytes .* budget is \d+", bad.error_message)
    assert bad.tokens == [] and bad.stats.peak_kv_bytes == 0
    # no page, no tail, no reservation, never admitted, prefilled or decoded
    assert big_kv.peak_pages == 0 and big_kv.pages == [] and big_kv.tail is None and big_kv.reserved == 0
    assert not {"big"} & {*hooks.keys("admitted"), *hooks.keys("prefill"), *hooks.keys("decode")}
    assert sorted(hooks.keys("admitted")) == ["a", "b", "c"]
    for k in ("a", "b", "c"):
        assert res[k].ok and res[k].finish_reason == "length" and len(res[k].tokens) == small
    s = eng.summary()
    assert s["peak_concurrency"] == 3
    # the pool never held more than the small rows' pages
    assert s["peak_pages_in_use"] <= 3 * math.ceil((10 + small) / P)
    assert s["rows_by_error_code"] == {"ok": 3, INSUFFICIENT_MEMORY: 1}
    all_pages_free(eng)


# ---- a budget for two rows, eight rows ------------------------------------------------------
def test_budget_for_two_rows_runs_eight_two_at_a_time(tiny_model):
    m = tiny_model()
    P, plen, new = 8, 12, 40
    worst = plen + new
    mm = memory_model(m[2], page_size=P, max_batch=8)
    budget = mm.bytes_for([worst] * 2, plen)
    assert mm.bytes_for([worst] * 3, plen) > budget
    reqs = [Request(f"r{i}", prompt(plen, i), SamplingParams(max_tokens=new)) for i in range(8)]

    running = []  # rows in each decode step

    class Watch(EngineHooks):
        def on_step(self, plan, times):
            if plan.decode:
                running.append(len(plan.decode))

    eng = make_engine(m, budget, Watch(), page_size=P, max_batch=8)
    assert eng.plan(worst, plen)["rows_fit"] == 2
    res = eng.generate(reqs)
    assert all(r.ok and r.finish_reason == "length" and len(r.tokens) == new for r in res)
    assert eng.summary()["peak_concurrency"] == 2 and max(running) == 2 and min(running) >= 1
    all_pages_free(eng)
    # the budget leaves MLX's buffer cache little room: it was given back to stay within it, and counted
    assert eng.summary()["cache_clears"] > 0

    # the same tokens as with room for all eight at once
    free = make_engine(m, BIG, page_size=P, max_batch=8)
    assert [r.tokens for r in free.generate(reqs)] == [r.tokens for r in res]
    assert free.summary()["peak_concurrency"] == 8


# ---- predicted KV bytes against the live buffers --------------------------------------------
@pytest.mark.parametrize("mode", ["none", "q8", "q4", "k8v4"])
def test_predicted_kv_bytes_match_live_buffers(tiny_model, mode):
    m = tiny_model()
    spec = m[2]
    P, tail_slots, pages = 16, 4, 96
    lay = kv_layout(spec, mode, P, 64)
    mm = memory_model(spec, mode, page_size=P, max_batch=tail_slots)

    # 1. the store alone, measured by MLX's allocator
    mx.eval()
    base = active_memory()
    cache = PagedKVCache(lay, spec.num_layers, mx.float32, tail_slots=tail_slots, upcast=False)
    tails = active_memory() - base
    row = CacheRow("x")
    cache.reserve(row, pages * P, BIG)
    kv_live = active_memory() - base - tails
    assert cache.capacity_pages == pages
    predicted = pages * lay.page_bytes  # == pages * P * bytes_per_token
    assert cache.store.nbytes == predicted  # the buffers' own nbytes: exact
    assert abs(kv_live - predicted) <= 0.10 * predicted, (kv_live, predicted)
    if lay.quantized:  # the full-precision tail pages: the workspace's tail term
        predicted_tails = tail_slots * P * lay.dense_bytes_per_token
        assert cache.store.tail_nbytes == predicted_tails
        assert abs(tails - predicted_tails) <= 0.10 * predicted_tails
        assert mm.workspace(1, 1) >= predicted_tails
    cache.release(row)
    del cache

    # 2. one row through the engine: its held KV against bytes_per_token x tokens, and the plan
    P = 4
    plen, new = 40, 560
    eng = make_engine(m, BIG, kv_mode=mode, page_size=P, max_batch=1)
    (res,) = eng.generate([Request("r", prompt(plen), SamplingParams(max_tokens=new))])
    assert res.ok and len(res.tokens) == new
    stored = plen + new - 1  # the last sampled token is never written
    s = eng.summary()
    lay = kv_layout(spec, mode, P, 64)  # the engine's layout
    assert (s["kv_bytes_per_token"], s["page_bytes"]) == (lay.bytes_per_token, lay.page_bytes)
    by_tokens = stored * s["kv_bytes_per_token"]
    assert abs(res.stats.peak_kv_bytes - by_tokens) <= 0.10 * by_tokens, (res.stats.peak_kv_bytes, by_tokens)
    held = s["peak_pages_in_use"] * s["page_bytes"]
    planned = eng.plan(plen + new, plen)["predicted_kv_bytes_per_row"]
    assert abs(held - planned) <= 0.10 * planned and held <= planned
    assert s["pool_bytes"] == s["pool_capacity_pages"] * s["page_bytes"]  # the live buffers' nbytes


# ---- sizes, budgets, plan ------------------------------------------------------------------
def test_parse_size_and_resolve_budget():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size(" 1.5 GiB ") == int(1.5 * (1 << 30))
    assert parse_size(12345) == parse_size("12345") == 12345
    assert resolve_budget("4GiB") == 4 << 30
    for bad in ("lots", "", "GiB", "8 parsecs", "-1GiB", "1e9"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="not a size"):
        resolve_budget("lots")
    with pytest.raises(ValueError, match=">= 0"):
        parse_size(-5)
    for fraction in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="memory.fraction"):
            resolve_budget("auto", fraction=fraction)
    with pytest.raises(ValueError, match="not a size"):
        resolve_budget("auto", 0.5, headroom="lots")


@cpu_only  # the GPU branches (device memory info) are test_available_memory_gpu_branches_...
def test_auto_budget_on_cpu_is_available_ram_times_fraction_minus_headroom(tiny_model, monkeypatch):
    # the CPU branch reads psutil's available RAM (plus what MLX keeps in its own buffer cache)
    assert not mx.metal.is_available() and not mx.cuda.is_available()
    a = memory_mod.available_memory()
    b = psutil.virtual_memory().available + mx.get_cache_memory()
    assert abs(a - b) < (256 << 20)

    monkeypatch.setattr(memory_mod, "available_memory", lambda: 8 << 30)
    assert resolve_budget("auto", 0.5, "1GiB") == 3 << 30
    assert resolve_budget(" AUTO ", 0.5, "1GiB", resident=100) == (3 << 30) + 100
    assert resolve_budget("auto", 0.1, "1GiB") == 0  # never negative
    # the engine's auto budget counts the loaded weights (they are no longer "available")
    m = tiny_model()
    eng = Engine(m[0], NoEos(m[1]), m[2], engine_config(memory_budget=None, memory_fraction=0.5,
                                                       memory_headroom="1GiB"))
    assert eng.stats()["budget_bytes"] == m[2].weights_bytes + (3 << 30) and m[2].weights_bytes > 0


def test_available_memory_gpu_branches_use_mlx_032_device_info_keys(monkeypatch):
    """Metal: recommended working set minus MLX's active memory; CUDA: free_memory (NVML) plus
    MLX's cache, or total_memory minus active. Keys as in mlx 0.32.4's mlx/device.h."""
    monkeypatch.setattr(mx, "get_active_memory", lambda: 2 << 30)
    monkeypatch.setattr(mx, "get_cache_memory", lambda: 1 << 30)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda d=None: {"max_recommended_working_set_size": 10 << 30,
                                                           "memory_size": 16 << 30})
    assert memory_mod.available_memory() == 8 << 30
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda d=None: {"free_memory": 5 << 30, "total_memory": 80 << 30})
    assert memory_mod.available_memory() == 6 << 30
    monkeypatch.setattr(mx, "device_info", lambda d=None: {"total_memory": 80 << 30})
    assert memory_mod.available_memory() == 78 << 30


def test_plan_line(tiny_model):
    m = tiny_model()
    spec = m[2]
    mm = memory_model(spec, "q4", page_size=16, max_batch=4)
    budget = mm.bytes_for([1000] * 5, 100)
    eng = make_engine(m, budget, kv_mode="q4", page_size=16, max_batch=4)
    plan = eng.plan(1000, 100)
    assert plan["rows_fit"] == 5 and plan["budget_bytes"] == budget
    bpt = kv_layout(spec, "q4", 16, 64).bytes_per_token
    assert plan["kv_bytes_per_token"] == eng.stats()["kv_bytes_per_token"] == bpt
    # the peak of the rows that run at once: 5 fit, the batch holds 4
    assert plan["rows_running"] == 4 and plan["predicted_peak_bytes"] == mm.bytes_for([1000] * 4, 100) < budget
    line = eng.plan_line(1000, 100)
    assert line == format_plan(plan) and "\n" not in line
    assert f"{bpt} B/token" in line and "5 rows of 1000 tokens fit at once" in line and "with 4 running" in line
    assert line.startswith("memory plan: budget ") and "weights " in line and "KV (q4)" in line


# ---- pool growth refused --------------------------------------------------------------------
def test_growth_refused_by_live_free_memory(tiny_model, monkeypatch):
    m = tiny_model()
    P = 4
    eng = make_engine(m, BIG, page_size=P, max_batch=3)
    (warm,) = eng.generate([Request("warm", prompt(8, 9), SamplingParams(max_tokens=56))])
    assert warm.ok and eng.stats()["pool_capacity_pages"] == 16  # 63 tokens stored: 16 pages
    growths = len(eng.summary()["growth_events"])

    monkeypatch.setattr(kv_cache_mod, "available_memory", lambda: 0)  # the machine has nothing left
    monkeypatch.setattr(kv_cache_mod, "mlx_cached_memory", lambda: 0)  # nor MLX's buffer cache
    reqs = [Request("s1", prompt(8, 1), SamplingParams(max_tokens=12)),
            Request("s2", prompt(8, 2), SamplingParams(max_tokens=12)),
            Request("long", prompt(8, 3), SamplingParams(max_tokens=100))]
    res = {r.key: r for r in eng.generate(reqs)}
    for k in ("s1", "s2"):  # 5 pages each, beside long's first 5: 15 of the 16 pages
        assert res[k].ok and len(res[k].tokens) == 12
    bad = res["long"]
    assert (bad.finish_reason, bad.error_code) == ("error", INSUFFICIENT_MEMORY)
    assert "refused" in bad.error_message and "machine free 0B" in bad.error_message
    assert len(bad.tokens) == 16 * P - 8 + 1  # it ran until it needed a 17th page
    s = eng.summary()
    assert s["pool_capacity_pages"] == 16 and len(s["growth_events"]) == growths  # nothing grew
    all_pages_free(eng)

    # what it produced before the refusal is what an unconstrained run produces
    monkeypatch.undo()
    free = make_engine(m, BIG, page_size=P, max_batch=3)
    (ref,) = free.generate([reqs[2]])
    assert ref.tokens[:len(bad.tokens)] == bad.tokens


def test_growth_within_budget_and_refusal_moves_nothing(tiny_model):
    spec = tiny_model()[2]
    P = 8
    lay = kv_layout(spec, "none", P, 64)
    L, pb = spec.num_layers, lay.page_bytes
    cache = PagedKVCache(lay, L, mx.float32, tail_slots=2, upcast=False)
    a = CacheRow("a")
    cache.reserve(a, 8 * P, BIG)
    assert cache.capacity_pages == 8
    a.length = 8 * P  # as if a forward pass stored them

    # doubling (16 pages) exceeds the budget: the pool grows to the most the budget takes (12), not to 9
    limit = 12 * pb + math.ceil(12 * pb / L)  # 12 pages + the one-layer growth copy
    cache.reserve(a, 1, limit)
    assert cache.capacity_pages == 12 and len(a.pages) == 9
    assert [(e["from_pages"], e["to_pages"]) for e in cache.growth_events][-1] == (8, 12)

    # a reservation the budget cannot take: refused, nothing moved
    b = CacheRow("b")
    before = (cache.capacity_pages, cache.pool.in_use, cache.pool.num_free, len(cache.growth_events))
    with pytest.raises(RowError) as e:
        cache.reserve(b, 10 * P, limit)
    assert e.value.code == INSUFFICIENT_MEMORY and "refused" in e.value.message
    assert b.pages == [] and b.reserved == 0 and b.peak_pages == 0
    assert (cache.capacity_pages, cache.pool.in_use, cache.pool.num_free, len(cache.growth_events)) == before
    # what fits without growing is still given
    cache.reserve(b, 3 * P, limit)
    assert len(b.pages) == 3 and cache.capacity_pages == 12


def test_limit_allocator_holds_mlx_to_the_budget_and_is_off_by_default(tiny_model):
    """memory.limit_allocator: MLX's allocator gets the engine's budget as its memory limit (so its cache of freed
    buffers goes back before the process passes the budget); without it MLX's own limit stays."""
    from dataclasses import replace

    import mlx.core as mx

    from kvbatch.engine.engine import Engine
    from kvbatch.engine.testing import engine_config

    model, tok, spec = tiny_model()
    mine = 1 << 40
    before = mx.set_memory_limit(mine)
    try:
        Engine(model, tok, spec, engine_config(memory_budget=3 << 28))
        assert mx.set_memory_limit(mine) == mine  # untouched
        cfg = engine_config(memory_budget=3 << 28)
        Engine(model, tok, spec, replace(cfg, memory=replace(cfg.memory, limit_allocator=True)))
        assert mx.set_memory_limit(mine) == 3 << 28
    finally:
        mx.set_memory_limit(before)
