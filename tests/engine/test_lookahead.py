"""Decode lookahead (runner.LookaheadStepper, on by default on GPU backends): the next
step is built and dispatched before the host reads the current step's tokens. It must give
the rows exactly what the step-by-step loop gives: tokens, finish reasons, error codes,
logits (within float tolerance: a waiting row joins one step later, so some steps run at
another batch size), with EOS, stop ids, stop strings, max_tokens, forced tokens, seeded
sampling, a non-finite row, continuous batching (more rows than slots) and page reuse.
"""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.testing import engine_config
from kvbatch.engine.errors import NON_FINITE_LOGITS
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

EOS = 257


def _prompt(i: int) -> list[int]:
    return [(31 * i + 7 * j + 5) % 256 for j in range(3 + (11 * i) % 37)]


def _stop_rows(m) -> tuple:
    """(prompt, params) of a row that stops on a stop id and of one that stops on a stop string,
    both mid-decode: found from greedy outputs (step by step) of candidate prompts."""
    model, tok, spec = m
    eng = Engine(model, tok, spec, engine_config(page_size=8, max_batch=8, memory_budget=2 << 30,
                                                options=EngineOptions(lookahead="off")))
    cands = [_prompt(100 + i) for i in range(48)]
    outs = [r.tokens for r in eng.generate([Request(f"c{i}", p, SamplingParams(max_tokens=30))
                                            for i, p in enumerate(cands)])]
    by_id = by_str = None
    for p, out in zip(cands, outs):
        for j in range(3, len(out)):
            if out[j] in out[:j]:
                continue
            if by_id is None:
                by_id = (p, SamplingParams(max_tokens=30, stop_token_ids=(out[j],)))
            if by_str is None and 33 <= out[j] < 127 and chr(out[j]) not in tok.decode(out[:j]):
                by_str = (p, SamplingParams(max_tokens=30, stop=(chr(out[j]),)))
    assert by_id and by_str, "no candidate prompt stops mid-decode"
    return by_id, by_str


def _requests(stops, hooks: EngineHooks) -> list[Request]:
    reqs = []
    for i in range(14):
        p = _prompt(i)
        kind = i % 7
        if kind == 0:
            sp = SamplingParams(max_tokens=30 + i)  # greedy, may stop on EOS
        elif kind in (1, 2):  # stops mid-decode on a stop id / a stop string
            p, sp = stops[kind - 1]
        elif kind == 3:
            sp = SamplingParams(max_tokens=35, temperature=0.9, seed=i)
        elif kind == 4:
            sp = SamplingParams(max_tokens=20, temperature=1.0, top_k=30, top_p=0.9, seed=100 + i)
        else:
            sp = SamplingParams(max_tokens=1 + i)  # short rows: slots free early
        forced = [(3 * i + 11 * j) % 256 for j in range(28)] if kind == 6 else None
        if forced is not None:
            hooks.force(f"r{i}", forced)
        elif kind == 0:
            hooks.capture_logits.add(f"r{i}")
        reqs.append(Request(f"r{i}", p, sp))
    return reqs


def _run(m, monkeypatch, lookahead: str, mode: str, stops):
    model, tok, spec = m
    hooks = EngineHooks(nonfinite=("r10", 3))
    opts = EngineOptions(lookahead="on" if lookahead == "1" else "off")
    eng = Engine(model, tok, spec, engine_config(kv_mode=mode, page_size=8, max_batch=4, prefill_chunk=16,
                                                memory_budget=2 << 30, options=opts), hooks)
    assert eng.lookahead == (lookahead == "1")
    async_calls = []
    real = mx.async_eval

    def spy(*a):
        async_calls.append(1)
        return real(*a)

    monkeypatch.setattr(mx, "async_eval", spy)
    try:
        res = eng.generate(_requests(stops, hooks))
    finally:
        monkeypatch.setattr(mx, "async_eval", real)
    s = eng.summary()
    assert s["pages_in_use"] == 0 and not s["decode_in_flight"]
    return res, hooks.logits, s, len(async_calls)


@pytest.mark.parametrize("mode", ["none", "q8"])
def test_lookahead_gives_the_step_by_step_results(tiny_model, monkeypatch, mode):
    m = tiny_model()
    stops = _stop_rows(m)
    base, lg0, s0, n0 = _run(m, monkeypatch, "0", mode, stops)
    ahead, lg1, s1, n1 = _run(m, monkeypatch, "1", mode, stops)
    assert n0 == 0 and n1 >= 40  # the lookahead loop really dispatched steps ahead
    by = {r.key: r for r in base}
    assert by["r10"].error_code == NON_FINITE_LOGITS and len(by["r10"].tokens) == 3
    assert {r.finish_reason for r in base} == {"stop", "length", "error"}  # the workload covers every ending
    assert [by[f"r{i}"].finish_reason for i in (1, 2, 8, 9)] == ["stop"] * 4
    assert all(len(by[f"r{i}"].tokens) >= 3 for i in (1, 2))  # they stopped mid-decode
    for a in ahead:
        b = by[a.key]
        assert (a.tokens, a.finish_reason, a.error_code) == (b.tokens, b.finish_reason, b.error_code), a.key
        assert a.text == b.text
        if b.key in lg0:
            la, lb = lg1[a.key], lg0[b.key]
            assert len(la) == len(lb) == len(b.tokens) + (b.finish_reason == "stop")
            assert max(mx.abs(x - y).max().item() for x, y in zip(la, lb)) <= 1e-4, a.key
    assert s1["generated_tokens"] == s0["generated_tokens"]
    assert s1["rows_by_error_code"] == s0["rows_by_error_code"] == {"ok": 13, NON_FINITE_LOGITS: 1}
    assert s1["decode_tokens_per_s"] > 0


def test_decode_clock_counts_a_step_dispatched_before_a_prefill_pass(tiny_model, monkeypatch):
    """The engine's decode seconds count every decode dispatch: with lookahead a read counts from the read (or
    prefill pass) before it, so a step dispatched before a prefill pass and read after it would lose its
    dispatch (on a GPU a cold process's first decode step dispatches for seconds). One injected clock that only
    dispatches advance, 5 s each: the prefill and decode seconds together are the run's whole time."""
    from types import SimpleNamespace

    import kvbatch.engine.runner as runner

    now = [0.0]
    dispatches = []

    class Dispatch:  # mlx.core, each decode dispatch taking 5 s on the injected clock
        def __getattr__(self, name):
            return getattr(mx, name)

        def async_eval(self, *arrays):
            now[0] += 5.0
            dispatches.append(now[0])
            return mx.async_eval(*arrays)

    monkeypatch.setattr(runner, "mx", Dispatch())
    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    model, tok, spec = tiny_model()
    eng = Engine(model, tok, spec, engine_config(page_size=16, max_batch=2, prefill_chunk=64, memory_budget=2 << 30,
                                                options=EngineOptions(lookahead="on")))
    # the short row decodes from the first engine step; the long row's second chunk is a prefill pass after it
    res = eng.generate([Request("short", _prompt(1)[:20], SamplingParams(max_tokens=3)),
                        Request("long", [5 + i % 50 for i in range(100)], SamplingParams(max_tokens=3))])
    assert [len(r.tokens) for r in res] == [3, 3]
    t = eng.runner.times
    assert t.prefill_passes == 2 and len(dispatches) >= 3
    assert t.prefill_time == 0.0 and t.decode_time == 5.0 * len(dispatches)  # none lost, none twice
