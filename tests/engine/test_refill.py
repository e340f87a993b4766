"""engine.refill_rows / refill_wait_steps: waiting rows join a batch that is decoding in groups (one prefill
pass for several rows instead of one for each row that ends), or once a slot has waited long enough; the rows'
tokens are those of rows joining at once."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import pytest

from kvbatch.engine.batch_limits import REFILL_DIVISOR, resolve_refill_rows
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request

SLOTS = 8
# 24 rows of 8 slots: short rows end one by one while long ones keep the batch decoding
MAX_TOKENS = [3, 40, 5, 44, 7, 38, 9, 42, 2, 4, 6, 8, 10, 12, 3, 5, 4, 9, 2, 7, 5, 3, 6, 4]


class Starts(EngineHooks):
    def __init__(self):
        super().__init__()
        self.started: list[str] = []

    def on_row_start(self, key):
        self.started.append(key)


def _run(m, refill_rows, wait: int, lookahead: str) -> tuple[dict, list[tuple[int, int, int, bool]], dict]:
    """The rows' tokens; per step (free slots before it, rows waiting before it, rows it started, whether any row
    was decoding before it); the engine's summary."""
    model, tok, spec = m
    hooks = Starts()
    eng = Engine(model, tok, spec, engine_config(max_batch=SLOTS, page_size=8, memory_budget=2 << 30,
                                                 refill_rows=refill_rows, refill_wait_steps=wait,
                                                 options=EngineOptions(lookahead=lookahead)), hooks)
    for i, n in enumerate(MAX_TOKENS):
        prompt = [(13 * i + 5 * j + 3) % 250 + 1 for j in range(6 + (7 * i) % 11)]
        eng.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=n, stop_token_ids=())))
    steps, out = [], {}
    while eng.has_unfinished():
        s = eng.stats()
        free, waiting = SLOTS - s["rows_running"], s["rows_waiting"]
        decoding = bool(eng.scheduler.decoding())
        before = len(hooks.started)
        for r in eng.step():
            out[r.key] = r.tokens
        steps.append((free, waiting, len(hooks.started) - before, decoding))
    return out, steps, eng.summary()


@pytest.mark.parametrize("lookahead", ["off", "on"])
def test_rows_join_a_decoding_batch_in_groups_with_the_same_tokens(tiny_model, lookahead):
    m = tiny_model()
    at_once, steps1, s1 = _run(m, 1, 64, lookahead)
    grouped, steps4, s4 = _run(m, 4, 1000, lookahead)
    assert len(at_once) == len(MAX_TOKENS) and grouped == at_once
    # with refill_rows 1 a row that ends is replaced at once: some step starts one row while 4 or more wait
    assert any(n == 1 and w >= 4 and dec for _, w, n, dec in steps1)
    # with 4, a decoding batch takes rows only in groups of 4 (or the last rows waiting), and only once 4 slots
    # are free (the wait never runs out here)
    joins = [(free, w, n) for free, w, n, dec in steps4 if n and dec]
    assert joins and all(n >= min(4, w) and free >= min(4, w) for free, w, n in joins), joins
    assert s4["prefill_passes"] < s1["prefill_passes"] and s4["refill_rows"] == 4
    assert s4["peak_concurrency"] == SLOTS


def test_a_free_slot_takes_a_waiting_row_once_it_has_waited_refill_wait_steps(tiny_model):
    """refill_rows = every slot: rows would wait for the whole batch to end; after refill_wait_steps steps
    with a slot free they join however few slots are free, never sooner."""
    m = tiny_model()
    wait = 5
    at_once, _, _ = _run(m, 1, 64, "off")
    got, steps, _ = _run(m, SLOTS, wait, "off")
    assert got == at_once
    held = 0
    early = []
    for free, w, n, dec in steps:
        if w and free and dec and free < min(SLOTS, w):
            if n:
                early.append(held)  # steps this slot had waited when rows joined
                held = 0
            else:
                held += 1
        else:
            held = 0
    assert early and all(h == wait for h in early), early


def test_refill_rows_auto_is_per_backend_and_bad_values_are_refused(tiny_model):
    assert resolve_refill_rows("auto", 512, "cpu") == 1
    for name in ("cuda", "metal"):
        assert resolve_refill_rows("auto", 512, name) == 512 // REFILL_DIVISOR[name]
        assert resolve_refill_rows("auto", 8, name) == 1
    assert resolve_refill_rows(3, 512, "cuda") == 3
    model, tok, spec = tiny_model()
    for bad in ({"refill_rows": 0}, {"refill_rows": "some"}, {"refill_wait_steps": -1}):
        with pytest.raises(KvbatchConfigError, match="engine.refill"):
            Engine(model, tok, spec, engine_config(memory_budget=1 << 30, **bad))
