"""The engine's public surface: add / step / has_unfinished / cancel / summary, and hooks.

The worker and every benchmark drive the engine through these alone, so they must hold on
their own: step() returns each row once, when it finishes; cancel() hands back what did
not finish and frees every page; the hooks object sees the crash points it is given.
"""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config


class Recorder(EngineHooks):
    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []

    def on_row_start(self, key):
        self.events.append(("start", key))

    def on_prefill_chunk(self, key, done, total):
        self.events.append(("chunk", key, done, total))

    def on_decode_step(self):
        self.events.append(("decode",))


def _engine(tiny_model, hooks=None, **kw):
    model, tok, spec = tiny_model()
    return Engine(model, tok, spec, engine_config(page_size=8, max_batch=2, prefill_chunk=4,
                                                  memory_budget=1 << 30, **kw), hooks)


def _req(key, n_prompt, max_tokens):
    return Request(key, [(7 * n_prompt + j) % 250 + 1 for j in range(n_prompt)], SamplingParams(max_tokens=max_tokens))


def test_step_returns_each_row_once_as_it_finishes(tiny_model):
    hooks = Recorder()
    eng = _engine(tiny_model, hooks)
    lengths = {"a": 3, "b": 20, "c": 5, "d": 1}
    for k, n in lengths.items():
        eng.add(_req(k, 6, n))
    assert eng.has_unfinished()
    seen, steps, empty = [], 0, 0
    while eng.has_unfinished():
        done = eng.step()
        steps += 1
        empty += not done
        seen += [r.key for r in done]
        assert all(r.ok and len(r.tokens) <= lengths[r.key] for r in done)
    assert sorted(seen) == sorted(lengths) and len(seen) == len(set(seen))
    assert empty > 0 and eng.step() == [] and not eng.has_unfinished()
    assert seen.index("d") < seen.index("b")  # a short row finishes before a long one admitted first
    s = eng.summary()
    assert s["rows_by_error_code"] == {"ok": 4} and s["peak_concurrency"] == 2
    assert s["options"]["lookahead"] == "auto" and s["options"]["cuda"]["chunk"] == 1024
    assert s["pages_in_use"] == 0 and s["pages_free"] == s["pool_capacity_pages"] > 0
    # hooks: every row started once; a 6-token prompt in chunks of 4 reports 4/6 then 6/6
    assert [e[1] for e in hooks.events if e[0] == "start"] == list(lengths)
    assert [e[2:] for e in hooks.events if e[0] == "chunk" and e[1] == "a"] == [(4, 6), (6, 6)]
    decodes = sum(e[0] == "decode" for e in hooks.events)
    assert max(lengths.values()) - 1 <= decodes <= steps  # b: 1 token from its prefill, 19 from decode steps


def test_cancel_hands_back_unfinished_rows_and_frees_pages(tiny_model):
    eng = _engine(tiny_model, options=EngineOptions(lookahead="on"))
    for k in "abc":
        eng.add(_req(k, 20, 50))
    eng.step()
    eng.step()
    s = eng.stats()
    assert (s["rows_running"], s["rows_waiting"]) == (2, 1) and s["pages_in_use"] > 0
    back = eng.cancel()
    assert sorted(r.key for r in back) == ["a", "b", "c"]
    s = eng.stats()
    assert s["pages_in_use"] == 0 and not eng.has_unfinished() and not s["decode_in_flight"]
    assert (s["rows_running"], s["rows_waiting"]) == (0, 0)
    # the engine goes on after a cancel
    res = eng.generate([_req("x", 5, 4)])
    assert res[0].ok and len(res[0].tokens) == 4


def test_teacher_forcing_and_capture_go_through_hooks(tiny_model):
    hooks = EngineHooks()
    eng = _engine(tiny_model, hooks)
    hooks.force("f", [5, 6, 7, 8, 9])
    hooks.capture_logits.add("g")
    res = {r.key: r for r in eng.generate([_req("f", 4, 100), _req("g", 4, 3), _req("h", 4, 3)])}
    assert res["f"].tokens == [5, 6, 7, 8, 9] and res["f"].finish_reason == "length"
    assert len(hooks.logits["f"]) == 5 and len(hooks.logits["g"]) == len(res["g"].tokens)
    assert "h" not in hooks.logits


def test_rope_table_option_decides_the_models_rope(tiny_model):
    """engine.options.rope_table: the CPU route's one-table-a-step RoPE, or MLX's own module."""
    import mlx.nn as nn

    from kvbatch.engine.backend import on_cpu
    from kvbatch.engine.kv.routes.rope_cpu import TableRoPE

    def ropes():
        return {type(m.rope) for _, m in tiny_model()[0].named_modules() if hasattr(m, "rope")}

    _engine(tiny_model, options=EngineOptions(rope_table=False))
    assert ropes() == {nn.RoPE}
    _engine(tiny_model, options=EngineOptions(rope_table=True))
    assert ropes() == ({TableRoPE} if on_cpu() else {nn.RoPE})
    _engine(tiny_model, options=EngineOptions(route="portable"))  # the portable route runs MLX's RoPE
    assert ropes() == {nn.RoPE}
