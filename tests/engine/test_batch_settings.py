"""engine.max_batch: auto resolves to the backend's ceiling and says so; bad batch settings are refused."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import pytest

from kvbatch.engine.backend import backend
from kvbatch.engine.batch_limits import BATCH_CEILING, PREFILL_TOKENS
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
