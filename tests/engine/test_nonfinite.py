"""Non-finite logits end one row, not the batch; the attention trace names the bad call (issue 6).

Fault injection is testing-only: EngineHooks(nonfinite=(row key, output step))
poisons layer 0's attention output of that row in the pass that produces that output
step (step 0 = the prefill pass(es), step k = the k-th decode step). Every test runs
the same batch with and without the injection and compares.
"""
from __future__ import annotations

import re

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import pytest

from kvbatch.engine.engine import Engine
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.testing import engine_config
from kvbatch.engine.errors import NON_FINITE_LOGITS, CacheLost
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from tests.conftest import kv_cache

BUDGET = 2 << 30
P = 4  # page size: small, so rows span many pages and the pool grows
TRACE = "[kvbatch attention]"


class NoEos:
    """The tiny tokenizer with EOS switched off: every row runs to max_tokens."""

    eos_token_ids: list[int] = []

    def __init__(self, tok):
        self._tok = tok

    def decode(self, tokens):
        return self._tok.decode(tokens)


def prompts(lengths, salt=0):
    return [[(29 * i + 11 * j + salt) % 256 for j in range(n)] for i, n in enumerate(lengths)]


PROMPTS = prompts([9, 14, 6, 11], salt=3)
KEYS = [f"r{i}" for i in range(len(PROMPTS))]
MAX_TOKENS = [24, 30, 20, 28]


def requests():
    return [Request(k, p, SamplingParams(max_tokens=n)) for k, p, n in zip(KEYS, PROMPTS, MAX_TOKENS)]


def make_engine(m, mode="none", inject=None, chunk=32, trace="off"):
    model, tok, spec = m
    return Engine(model, NoEos(tok), spec, engine_config(kv_mode=mode, page_size=P, max_batch=4, prefill_chunk=chunk,
                                                        memory_budget=BUDGET,
                                                        options=EngineOptions(attention_trace=trace)),
                  EngineHooks(nonfinite=inject))


def spy_passes(eng):
    """Record every forward pass the cache is given, as the cache sees it (the poison flags are where the
    injection reaches it): (row keys, their offsets, L, capacity in tokens, poison flags)."""
    passes = []
    cache = kv_cache(eng)
    begin = cache.begin

    def recording_begin(rows, L, poison=None, lens=None):
        passes.append(([r.key for r in rows], [r.length for r in rows], L,
                       cache.capacity_pages * cache.P, list(poison) if poison else [False] * len(rows)))
        return begin(rows, L, poison, lens)

    cache.begin = recording_begin
    return passes


def all_pages_free(eng):
    s = eng.stats()
    assert s["pages_in_use"] == 0
    assert s["pages_free"] == s["pool_capacity_pages"]
    if s["kv_mode"] != "none":  # every tail slot given back (the cache's own slots: no stats key)
        assert sorted(kv_cache(eng).free_tails) == list(range(s["max_batch"]))


@pytest.fixture(scope="module")
def clean_runs(tiny_model):
    """Tokens of the batch without injection, per KV mode."""
    out = {}
    for mode in ("none", "q8"):
        eng = make_engine(tiny_model(), mode)
        res = eng.generate(requests())
        assert all(r.ok and r.finish_reason == "length" for r in res)
        out[mode] = {r.key: r.tokens for r in res}
    return out


def logged(caplog) -> str:
    """The log messages captured so far, one a line."""
    return "\n".join(caplog.messages)


def parse_trace(err: str) -> list[dict]:
    lines = [ln for ln in err.splitlines() if ln.startswith(TRACE)]
    return [dict(re.findall(r"(\w+)=(\S+?(?:\([^)]*\))?)(?=\s|$)", ln)) for ln in lines]


@pytest.mark.parametrize("mode", ["none", "q8"])
@pytest.mark.parametrize("step", [0, 7])
def test_nan_row_ends_alone_and_trace_names_it(tiny_model, clean_runs, monkeypatch, caplog, mode, step):
    m = tiny_model()
    eng = make_engine(m, mode, inject=("r1", step), trace="nonfinite")
    passes = spy_passes(eng)
    caplog.clear()
    res = {r.key: r for r in eng.generate(requests())}
    err = logged(caplog)

    bad = res["r1"]
    assert bad.finish_reason == "error" and bad.error_code == NON_FINITE_LOGITS
    counts = re.search(rf"output step {step}: (\d+) NaN, (\d+) inf", bad.error_message)
    assert counts, bad.error_message
    assert int(counts.group(1)) == m[2].vocab_size and int(counts.group(2)) == 0  # NaN spreads to every logit
    assert bad.tokens == clean_runs[mode]["r1"][:step]  # what it had produced before the bad step
    for k in ("r0", "r2", "r3"):
        assert res[k].ok and res[k].finish_reason == "length"
        assert res[k].tokens == clean_runs[mode][k], k  # batch mates untouched, token for token
    all_pages_free(eng)
    assert eng.summary()["rows_by_error_code"] == {"ok": 3, NON_FINITE_LOGITS: 1}

    # the trace: one line per poisoned pass, for r1 only, naming layer, cache, route, offset, capacity
    poisoned = [(keys[i], offs[i], L, cap) for keys, offs, L, cap, flags in passes
                for i in range(len(keys)) if flags[i]]
    assert len(poisoned) == 1  # one prefill chunk (step 0) or one decode step
    lines = parse_trace(err)
    assert len(lines) == len(poisoned), err
    for ln, (_key, offset, L, cap) in zip(lines, poisoned):
        assert ln["row"] == "r1"
        assert ln["layer"] == "0"
        assert ln["cache"] == f"PagedLayerCache(layer=0, mode={mode}, page_size={P})"
        assert ln["route"] == eng.stats()["route"]
        assert int(ln["offset"]) == offset == (0 if step == 0 else len(PROMPTS[1]) + step - 1)
        assert int(ln["L"]) == L == (len(PROMPTS[1]) if step == 0 else 1)
        assert int(ln["capacity"]) == cap >= offset + L
        assert int(ln["nonfinite"]) > 0
    assert not any(ln["row"] != "r1" for ln in lines)


def test_prefill_injection_over_several_chunks(tiny_model, clean_runs, monkeypatch, caplog):
    """Step 0 with a prompt of 3 chunks: every chunk of that row's prefill is poisoned and traced."""
    eng = make_engine(tiny_model(), "none", inject=("r1", 0), chunk=5, trace="nonfinite")  # r1's 14-token prompt: 5+5+4
    passes = spy_passes(eng)
    caplog.clear()
    res = {r.key: r for r in eng.generate(requests())}
    lines = parse_trace(logged(caplog))
    assert res["r1"].error_code == NON_FINITE_LOGITS and res["r1"].tokens == []
    assert all(res[k].tokens == clean_runs["none"][k] for k in ("r0", "r2", "r3"))  # chunking changes nothing
    poisoned = [(offs[0], L) for keys, offs, L, cap, flags in passes if any(flags)]
    assert poisoned == [(0, 5), (5, 5), (10, 4)]
    assert [(int(ln["offset"]), int(ln["L"])) for ln in lines] == poisoned
    assert all(ln["row"] == "r1" for ln in lines)
    all_pages_free(eng)


def test_trace_off_logs_nothing(tiny_model, monkeypatch, caplog):
    eng = make_engine(tiny_model(), "none", inject=("r2", 3))
    assert eng.stats()["options"]["attention_trace"] == "off"
    caplog.clear()
    res = {r.key: r for r in eng.generate(requests())}
    assert res["r2"].error_code == NON_FINITE_LOGITS
    assert TRACE not in logged(caplog)


def test_trace_nonfinite_is_silent_on_a_clean_run(tiny_model, monkeypatch, caplog):
    eng = make_engine(tiny_model(), "q8", trace="nonfinite")
    caplog.clear()
    assert all(r.ok for r in eng.generate(requests()))
    assert TRACE not in logged(caplog)


def test_trace_all_logs_every_attention_call(tiny_model, monkeypatch, caplog):
    m = tiny_model()
    eng = make_engine(m, "none", trace="all")
    passes = spy_passes(eng)
    caplog.clear()
    reqs = requests()[:2]
    assert all(r.ok for r in eng.generate(reqs))
    lines = parse_trace(logged(caplog))
    # one line per row per layer per pass, all finite
    layers = m[2].num_layers
    assert len(lines) == layers * sum(len(keys) for keys, *_ in passes)
    assert {ln["row"] for ln in lines} == {"r0", "r1"}
    assert {ln["layer"] for ln in lines} == {str(i) for i in range(layers)}
    assert all(ln["nonfinite"] == "0" for ln in lines)


@pytest.mark.parametrize("mode", ["none", "q8"])
def test_nan_written_in_a_shared_pass_does_not_reach_batch_mates(tiny_model, mode):
    """r0 (admitted first: it owns page 0) has a 2-token prompt, so its decode step 1 writes NaN K/V
    into page 0 in the same pass as its batch mates attend. Rows with fewer pages than the widest
    row pad their page tables: the padding must never point at another row's page (masked slots
    still meet probs @ V, and 0 * NaN is NaN). Afterwards r0's pages are zeroed before reuse."""
    lengths = [2, 14, 6, 11]
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts(lengths, salt=8))]
    m = tiny_model()
    clean = {r.key: r.tokens for r in make_engine(m, mode).generate(reqs)}
    eng = make_engine(m, mode, inject=("r0", 1))
    owners = {}
    cache = kv_cache(eng)  # which pages each row got first: r0's must be page 0
    reserve = cache.reserve

    def spy(row, n, limit, *rest):
        reserve(row, n, limit, *rest)
        owners.setdefault(row.key, list(row.pages))

    cache.reserve = spy
    res = {r.key: r for r in eng.generate(reqs)}
    assert 0 in owners["r0"]
    assert res["r0"].error_code == NON_FINITE_LOGITS and len(res["r0"].tokens) == 1
    for k in ("r1", "r2", "r3"):
        assert res[k].ok and res[k].tokens == clean[k], k
    all_pages_free(eng)


@pytest.mark.parametrize("fault_at", [2, 6])  # a prefill pass of all four rows; a decode step
def test_a_pass_that_leaves_the_cache_unreadable_raises_cache_lost(tiny_model, fault_at):
    """A pass that fails when evaluated leaves its cache writes holding the failed graph (MLX arrays raise again
    whenever read): the engine says so (CacheLost, naming the failure) at once, rather than ending the rows with
    internal_error and failing later on an unrelated read, and a prefill pass is not split into one futile pass
    a row."""
    model, tok, spec = tiny_model()
    hooks = EngineHooks(eval_fault_at=fault_at)
    eng = Engine(model, tok, spec, engine_config(max_batch=4, memory_budget=1 << 30, prefill_chunk=4), hooks)
    reqs = [Request(f"r{i}", [1 + i, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(4)]
    with pytest.raises(CacheLost, match=r"a failed pass left the KV cache unreadable: RuntimeError: \[GatherMM"):
        eng.generate(reqs)
    assert hooks.forward_passes == fault_at  # nothing ran after the failed pass
