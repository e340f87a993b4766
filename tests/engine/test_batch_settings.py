"""engine.max_batch: auto resolves to the backend's ceiling and says so; bad batch settings are refused."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import pytest

from kvbatch.engine.backend import backend
from kvbatch.engine.batch_limits import (AT_WORST_MAX_PARAMS, BATCH_CEILING, BATCH_CEILING_AT_WORST, PREFILL_TOKENS,
                                         BatchLimit, resolve_max_batch)
from kvbatch.engine.engine import Engine
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request


def test_max_batch_auto_is_the_backend_ceiling_and_the_plan_says_so(tiny_model):
    model, tok, spec = tiny_model()
    eng = Engine(model, tok, spec, engine_config(max_batch="auto", memory_budget=1 << 30))
    name = backend().name
    assert eng.max_batch == BATCH_CEILING[name]
    # the scheduler runs that many rows at once, never more: one row more than the ceiling, two steps
    res = eng.generate([Request(f"r{i}", [1 + i % 250, 1 + i // 250], SamplingParams(max_tokens=1))
                        for i in range(eng.max_batch + 1)])
    assert all(r.ok for r in res) and eng.summary()["peak_concurrency"] == eng.max_batch
    assert eng.prefill_tokens == max(PREFILL_TOKENS[name], 512)
    s = eng.summary()
    assert (s["max_batch"], s["admission"], s["prefill_tokens"]) == (eng.max_batch, "reserve", eng.prefill_tokens)
    assert f"up to {eng.max_batch} rows (auto: the {name} ceiling)" in eng.plan_line(64)
    fixed = Engine(model, tok, spec, engine_config(max_batch=5, memory_budget=1 << 30))
    assert fixed.max_batch == 5 and "up to 5 rows (engine.max_batch)" in fixed.plan_line(64)


def test_auto_is_the_ceiling_and_a_small_model_on_cuda_goes_past_it_at_worst_case():
    """Auto is the backend's ceiling; on MLX CUDA a model of at most AT_WORST_MAX_PARAMS parameters gets the second
    ceiling, past the first only while every row fits at its worst case, and a larger one stays at the first. A
    number asked for is the limit as asked, with no such rule."""
    small, large = AT_WORST_MAX_PARAMS, AT_WORST_MAX_PARAMS + 1
    for name in ("cpu", "metal"):
        for params in (small, large):
            assert resolve_max_batch("auto", params, name) == BatchLimit(BATCH_CEILING[name],
                                                                         f"auto: the {name} ceiling")
    cuda = resolve_max_batch("auto", small, "cuda")
    assert (cuda.rows, cuda.at_worst_from) == (BATCH_CEILING_AT_WORST["cuda"], BATCH_CEILING["cuda"])
    assert BATCH_CEILING_AT_WORST["cuda"] > BATCH_CEILING["cuda"]
    assert f"past {BATCH_CEILING['cuda']} only while every row fits at its worst case" in cuda.why
    big = resolve_max_batch("auto", large, "cuda")
    assert (big.rows, big.at_worst_from) == (BATCH_CEILING["cuda"], None)
    assert "over 0.5B parameters" in big.why
    assert resolve_max_batch(300, small, "cuda") == BatchLimit(300, "engine.max_batch")


def test_rows_past_at_worst_from_join_only_while_every_row_fits_at_its_worst_case(tiny_model):
    """Under optimistic admission, 8 rows that grow to 20 + 200 tokens in a budget that holds 5 of them at
    their worst case: all 8 join and the growth preempts some. With rows past 3 joining only at worst case
    (what auto does past a backend's second ceiling), 5 run at once and none is ever preempted; the tokens are the
    same (greedy)."""
    model, tok, spec = tiny_model()
    prompts = [[1 + (i * 7 + j) % 250 for j in range(20)] for i in range(8)]
    worst = 20 + 200
    probe = Engine(model, tok, spec, engine_config(max_batch=8, memory_budget=1 << 30, page_size=16,
                                                   admission="optimistic"))
    m = probe.memory
    budget = (m.bytes_for([worst] * 5, 20) + m.bytes_for([worst] * 6, 20)) // 2  # five fit at worst, not six

    def run(at_worst_from):
        eng = Engine(model, tok, spec, engine_config(max_batch=8, memory_budget=budget, page_size=16,
                                                     admission="optimistic"))
        eng.scheduler.at_worst_from = at_worst_from
        res = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
                            for i, p in enumerate(prompts)])
        assert all(r.ok and len(r.tokens) == 200 for r in res)
        return eng.summary(), [r.tokens for r in res]

    held, tokens = run(3)
    assert (held["peak_concurrency"], held["preemptions"]) == (5, 0)
    free, free_tokens = run(None)
    assert free["peak_concurrency"] == 8 and free["preemptions"] > 0
    assert tokens == free_tokens


@pytest.mark.parametrize("kw,key", [(dict(admission="greedy"), "engine.admission"),
                                    (dict(max_batch=0), "engine.max_batch"),
                                    (dict(max_batch="lots"), "engine.max_batch"),
                                    (dict(prefill_tokens=0), "engine.prefill_tokens")])
def test_bad_batch_settings_are_refused_with_the_key(kw, key):
    with pytest.raises(KvbatchConfigError, match=key):
        engine_config(**kw).check()


@pytest.mark.parametrize("admission", ["optimistic", "reserve"])
def test_a_prefill_pass_prices_the_running_rows_once(tiny_model, admission):
    """The growth limits (kv_limit, pool_want) scan every running row, so a step computes them once for its
    prefill pass, however many rows the pass takes, and once for its decode rows: a chunk's reservation stays
    within its row's target and changes no row's price. The pass of 8 rows still reserves each row's pages."""
    model, tok, spec = tiny_model()
    eng = Engine(model, tok, spec, engine_config(max_batch=8, memory_budget=1 << 30, prefill_tokens=4096,
                                                 prefill_chunk=64, admission=admission, page_size=16))
    s = eng.scheduler
    real, per_step = s.limits, []
    s.limits = lambda: per_step.__setitem__(-1, per_step[-1] + 1) or real()  # type: ignore[method-assign]
    for i in range(8):
        eng.add(Request(f"r{i}", [1 + (i * 7 + j) % 250 for j in range(100 + 20 * i)], SamplingParams(max_tokens=4)))
    while eng.has_unfinished():
        per_step.append(0)
        eng.step()
    assert per_step[0] <= 2  # the first step admits all 8 and prefills their first chunks in one pass
    assert max(per_step) <= 2, per_step
    assert eng.summary()["peak_concurrency"] == 8


@pytest.mark.parametrize("admission", ["optimistic", "reserve"])
def test_host_work_a_step_grows_with_rows_not_their_square(tiny_model, admission):
    """A step's host work stays linear in the running rows: admitting N rows prices each running row about
    once (the running rows' totals are kept through the admission loop, not summed again for every row it
    admits: that was N * (N + 1) / 2 prices), and a decode step reserves through make_room only the rows
    whose next token needs a new page (the others' pages already hold it). The tokens are those of a batch
    of one row at a time."""
    model, tok, spec = tiny_model()
    prompts = [[1 + (i * 7 + j) % 250 for j in range(5 + 3 * i)] for i in range(48)]

    def run(max_batch: int):
        eng = Engine(model, tok, spec, engine_config(max_batch=max_batch, memory_budget=1 << 30, prefill_tokens=8192,
                                                     prefill_chunk=64, admission=admission, page_size=16))
        s = eng.scheduler
        counts = {"priced": [0], "make_room": [0]}
        for name in counts:
            real = getattr(s, name)
            setattr(s, name, lambda *a, _real=real, _n=name, **k: counts[_n].__setitem__(-1, counts[_n][-1] + 1)
                    or _real(*a, **k))
        for i, p in enumerate(prompts):
            eng.add(Request(f"r{i}", p, SamplingParams(max_tokens=24)))
        tokens = {}
        while eng.has_unfinished():
            tokens.update((r.key, r.tokens) for r in eng.step())
            for c in counts.values():
                c.append(0)
        return counts, tokens

    counts, tokens = run(48)
    assert counts["priced"][0] <= 6 * 48, counts["priced"]  # the first step admits all 48 and prefills them
    # 48 rows x 24 tokens in 16-token pages: a row asks for a page at most 3 times in its decode
    assert sum(counts["make_room"]) <= 4 * 48, counts["make_room"]
    assert tokens == run(1)[1]
