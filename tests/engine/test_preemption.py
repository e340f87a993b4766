"""Optimistic admission: rows admitted on what they need now; when growth cannot fit, the most
recently admitted rows are preempted and resume later, with the same outputs."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.errors import INSUFFICIENT_MEMORY
from tests.conftest import PlanRecorder
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config
from tests.engine.test_engine_paged import prompts_of

P, ROWS, STEPS = 16, 6, 300
LENGTHS = [20, 9, 31, 14, 25, 5]
# kv none: float tolerance. q8/q4: the bounds the KV-quant tests allow a step that meets a one-step
# rounding flip: a resumed row prefills its generated tokens again, and a prefill pass attends to its own
# tokens at full precision where decode read them quantized once their page was sealed
TOL = {"none": 1e-4, "q8": 10e-4, "q4": 170e-4}


def _engine(m, mode, budget, admission, **kw):
    model, tok, spec = m
    return Engine(model, tok, spec, engine_config(kv_mode=mode, page_size=P, max_batch=6, prefill_chunk=32,
                                                 memory_budget=budget, admission=admission, **kw), PlanRecorder())


def _budget(m, mode) -> int:
    """Room for two rows at their full length (six start at once under optimistic admission)."""
    probe = _engine(m, mode, 2 << 30, "reserve")
    return probe.memory.bytes_for([max(LENGTHS) + STEPS] * 2, max(LENGTHS))


def _run(m, mode, budget, admission, forced=True, **kw):
    eng = _engine(m, mode, budget, admission, **kw)
    prompts = prompts_of(LENGTHS, salt=3)
    if forced:
        for i in range(ROWS):
            eng.hooks.force(f"r{i}", [(13 * i + 5 * j) % 256 for j in range(STEPS)])
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=STEPS)) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add(r)
    return list(eng.run()), eng


@pytest.mark.parametrize("mode", ["none", "q8", "q4"])
def test_preempted_rows_finish_with_the_same_outputs(tiny_model, mode):
    m = tiny_model(num_layers=8)
    budget = _budget(m, mode)
    ref, ref_eng = _run(m, mode, 2 << 30, "reserve")
    got, eng = _run(m, mode, budget, "optimistic")
    s = eng.summary()
    # every row exactly once, all complete
    assert sorted(r.key for r in got) == sorted(r.key for r in ref) == [f"r{i}" for i in range(ROWS)]
    assert all(r.ok and r.finish_reason == "length" and len(r.tokens) == STEPS for r in got)
    assert s["preemptions"] > 0 and sum(r.stats.preemptions for r in got) == s["preemptions"]
    assert ref_eng.summary()["preemptions"] == 0
    # the steps' plans name every preemption, and each preempted row is admitted again by a later step
    plans = eng.hooks.plans
    assert sum(len(p.preempted) for p in plans) == s["preemptions"]
    for i, p in enumerate(plans):
        for row in p.preempted:
            assert any(row in q.admitted for q in plans[i + 1:])
    assert s["peak_concurrency"] > 2  # more rows ran than their worst cases allow
    # the KV pool never outgrew the budget
    assert s["weights_bytes"] + s["peak_capacity_pages"] * s["page_bytes"] <= budget
    assert s["pages_in_use"] == 0
    by_key = {r.key: r for r in ref}
    worst = 0.0
    for r in got:
        assert r.tokens == by_key[r.key].tokens
        a, b = mx.stack(eng.hooks.logits[r.key]), mx.stack(ref_eng.hooks.logits[r.key])
        assert a.shape == b.shape == (STEPS, m[2].vocab_size)
        worst = max(worst, mx.abs(a - b).max().item())
    assert worst <= TOL[mode]


@pytest.mark.parametrize("lookahead", ["off", "on"])  # on: a preemption first lands the step in flight
def test_preempted_greedy_rows_match_an_unpreempted_run(tiny_model, lookahead):
    m = tiny_model(num_layers=8)
    ref, _ = _run(m, "none", 2 << 30, "reserve", forced=False)
    got, eng = _run(m, "none", _budget(m, "none"), "optimistic", forced=False,
                    options=EngineOptions(lookahead=lookahead))
    assert eng.lookahead == (lookahead == "on")
    s = eng.summary()
    assert s["preemptions"] > 0
    assert {r.key: r.tokens for r in got} == {r.key: r.tokens for r in ref}
    # prefix caching: a preempted row's full pages (prompt and generated tokens) stay cached while the pool
    # has room; readmitted, the row takes those that survived instead of computing them again
    assert s["prompt_tokens_cached"] > 0 and s["page_evictions"] > 0


def test_row_that_never_fits_alone_is_refused_under_optimistic(tiny_model):
    m = tiny_model(num_layers=8)
    budget = _budget(m, "none")
    eng = _engine(m, "none", budget, "optimistic")
    for i, p in enumerate(prompts_of(LENGTHS, salt=3)):
        eng.add(Request(f"r{i}", p, SamplingParams(max_tokens=STEPS)))
    eng.add(Request("big", [1] * 10, SamplingParams(max_tokens=40 * STEPS)))
    res = {r.key: r for r in eng.run()}
    assert res["big"].error_code == INSUFFICIENT_MEMORY and res["big"].tokens == []
    assert all(res[f"r{i}"].ok for i in range(ROWS))
