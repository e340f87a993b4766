"""The mixed and rotated KV modes (issue 27): k8v4, kv.rotate_keys, kv.full_precision_tokens.

What is proven here, for each mode on the llama (head 64; rotated keys also head 128) and qwen3
(head 128) test models, at page sizes 16 and 64, in batches of 8 rows of different lengths (the CPU
route with keys per channel, and the portable route with keys per token; on MLX CUDA the fused
kernel):
- the stored pages are the mode's (keys and values at their own bits);
- teacher-forced logits equal tests/engine/kv_reference.py's stored-pages reference within the q8/q4
  tests' tolerance at every step: that reference turns the stored keys back by the rotation and
  reads the first tokens in full precision, so a mode that skipped either would be far off;
- the memory model prices each mode's bytes (the live buffers match it);
- what a backend cannot run fails at start with one line.
"""
from __future__ import annotations

import mlx.core as mx
import pytest

from kvbatch.engine.backend import on_cpu
from kvbatch.engine.config import EngineOptions, KVConfig
from kvbatch.engine.engine import Engine
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.gate import VALIDATED
from kvbatch.engine.kv.rotation import hadamard
from kvbatch.engine.memory import kv_layout, layout_for
from kvbatch.engine.kv.routes import portable
from kvbatch.engine.kv.routes.cuda import ROUTE_CUDA_Q
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config
from tests.conftest import ON_CUDA, expected_route, kv_cache
from tests.engine.kv_reference import StoredPagesRefCache, teacher_forced_logits
from tests.engine.test_kv_quant import BUDGET, CHUNK, TOL, PageSnapshots, _requests, _rows

# name -> (kv.mode, more KVConfig fields, the gate's entry)
MODES = {
    "k8v4": ("k8v4", {}, "k8v4"),
    "q8+rot": ("q8", {"rotate_keys": True}, "rotate_keys"),
    "q4+rot": ("q4", {"rotate_keys": True}, "rotate_keys"),
    "k8v4+rot": ("k8v4", {"rotate_keys": True}, "rotate_keys"),
    # first tokens dense: a part of a page at 64, several pages and a part at 16
    "q4+fp40": ("q4", {"full_precision_tokens": 40}, "full_precision_tokens"),
    "q4+rot+fp16": ("q4", {"rotate_keys": True, "full_precision_tokens": 16}, "full_precision_tokens"),
}
GEOMS = (("llama", 64), ("qwen3", 128))
FP_ON_CUDA = "kv.full_precision_tokens is refused on MLX CUDA (test_mode_matches_stored_pages_reference checks it)"
CASES = [(name, fam, hd, page, "auto") for name in MODES for fam, hd in GEOMS for page in (16, 64)]
CASES += [(name, "llama", 64, 16, "portable") for name in MODES]
CASES += [(name, "llama", 128, page, "auto") for name in MODES if "+" in name for page in (16, 64)]


def _kv(name: str) -> dict:
    mode, extra, _ = MODES[name]
    return {"kv_mode": mode, "kv": extra}


def _layout(spec, name, page):
    """The layout the engine must store for this mode (worked out apart from any engine)."""
    mode, extra, _ = MODES[name]
    return layout_for(spec, KVConfig(mode=mode, page_size=page, group_size=64, **extra))


def _engine(model, tok, spec, name, page, route="auto", max_batch=8, **kw):
    cfg = engine_config(page_size=page, group_size=64, max_batch=max_batch, prefill_chunk=CHUNK[page],
                        memory_budget=BUDGET, options=EngineOptions(route=route), **_kv(name), **kw)
    return Engine(model, tok, spec, cfg)


@pytest.mark.parametrize("name,family,head_dim,page,route", CASES,
                         ids=[f"{n}-{f}-h{h}-p{p}" + ("-portable" if r == "portable" else "")
                              for n, f, h, p, r in CASES])
def test_mode_matches_stored_pages_reference(tiny_model, name, family, head_dim, page, route):
    model, tok, spec = tiny_model(family=family, head_dim=head_dim)
    assert MODES[name][2] in VALIDATED[(family, head_dim)]
    if route == "portable" and ON_CUDA:  # quantized_matmul is not validated on MLX CUDA: the gate refuses it
        with pytest.raises(KvbatchConfigError, match="not validated on the MLX cuda backend"):
            _engine(model, tok, spec, name, page, route)
        return
    if MODES[name][1].get("full_precision_tokens") and expected_route(spec, MODES[name][0], 64, route) == ROUTE_CUDA_Q:
        # the fused CUDA decode kernel does not read the dense first-token copy: refused, not ignored
        with pytest.raises(KvbatchConfigError, match="kv.full_precision_tokens is not built in the fused CUDA"):
            _engine(model, tok, spec, name, page, route)
        return
    prompts, forced = _rows(seed=head_dim + page + len(name))
    eng = _engine(model, tok, spec, name, page, route)
    cache = kv_cache(eng)  # the store under test: the pages it holds
    lay, st = _layout(spec, name, page), cache.store
    kb, vb = lay.key_bits, lay.value_bits
    assert (st.key_bits, st.value_bits) == (kb, vb)
    D = spec.head_dim
    k_width = page * kb // 32 if st.k_axis == "channel" else D * kb // 32
    snap = PageSnapshots(cache)
    results = eng.generate(_requests(eng, prompts, forced))
    s = eng.summary()
    want_route = expected_route(spec, MODES[name][0], 64, route)
    assert s["peak_concurrency"] == 8 and s["route"] == want_route and s["kv_label"] == lay.label
    assert (s["key_bits"], s["value_bits"], s["kv_k_axis"]) == (kb, vb, st.k_axis)
    assert (s["rotate_keys"], s["full_precision_tokens"]) == (lay.rotate_keys, lay.full_precision_tokens)
    if route == "portable":
        assert type(cache.attention) is portable.PortableQuantRoute and st.k_axis == "token"
    # the pages hold keys and values at their own bits
    assert st.q[0][0].shape[-1] == k_width and st.q[0][3].shape[-1] == D * vb // 32
    rot = mx.array(hadamard(D).astype("float32")) if lay.rotate_keys else None
    worst = 0.0
    for res, p, f in zip(results, prompts, forced):
        assert res.ok and res.finish_reason == "length", (res.error_code, res.error_message)
        got = eng.hooks.logits[res.key]
        store, n = snap.store(res.key), snap.n_pages(res.key)
        ref = teacher_forced_logits(model, p, f, lambda: [
            StoredPagesRefCache(store, i, list(range(n)), rot, lay.full_precision_tokens)
            for i in range(len(model.layers))], CHUNK[page])
        assert len(got) == len(ref) == len(f)
        for step, (a, b) in enumerate(zip(got, ref)):
            d = mx.abs(a - b).max().item()
            worst = max(worst, d)
            assert d <= TOL, f"{res.key} step {step}: stored-pages reference differs by {d:.2e}"
    sealed = [(len(p) + len(f) - 1) // page for p, f in zip(prompts, forced)]
    assert max(sealed) >= 4 and sum(x >= 2 for x in sealed) >= 4  # rows cross several page boundaries


def test_bytes_per_token_priced_per_mode(tiny_model):
    """k8v4 stores q8's keys and q4's values: its bytes per token are exactly half of each."""
    *_, spec = tiny_model()
    bpt = {m: kv_layout(spec, m, 64, 64).bytes_per_token for m in ("q8", "q4", "k8v4")}
    assert 2 * bpt["k8v4"] == bpt["q8"] + bpt["q4"]
    assert kv_layout(spec, "q8", 64, 64, value_bits=4).bytes_per_token == bpt["k8v4"]
    assert KVConfig(mode="q8", value_bits=4).label == "k8v4" and KVConfig(mode="k8v4").kv_bits == (8, 4)


def test_first_tokens_priced_and_held_per_slot(tiny_model):
    """kv.full_precision_tokens=N costs no bytes per token; each batch slot holds N dense tokens beside
    its tail page (KVLayout.slot_bytes, what the memory model's workspace counts), in the live buffers."""
    if ON_CUDA:
        pytest.skip(FP_ON_CUDA)
    model, tok, spec = tiny_model()
    eng = _engine(model, tok, spec, "q4+fp40", 16, max_batch=4)
    lay, s = _layout(spec, "q4+fp40", 16), eng.stats()
    assert s["kv_bytes_per_token"] == lay.bytes_per_token == kv_layout(spec, "q4", 16, 64).bytes_per_token
    assert s["kv_label"] == lay.label == "q4+fp40" and s["full_precision_tokens"] == 40
    assert lay.slot_bytes == (16 + 40) * lay.dense_bytes_per_token
    # the live buffers: tail pages and first-token copies, N tokens each
    assert s["kv_tail_bytes"] == s["max_batch"] * lay.slot_bytes and kv_cache(eng).store.fk[0].shape[2] == 40


def test_first_tokens_follow_a_fork(tiny_model):
    """Samples of one prompt are forked from its first row (kv.cache.fork): each continues with the
    first row's dense copy of the first tokens, so teacher-forced, every sample's logits equal a
    lone row's (a fork that left its copy empty would attend to zeros there)."""
    if ON_CUDA:
        pytest.skip(FP_ON_CUDA)
    model, tok, spec = tiny_model()
    prompts, forced = _rows(seed=7, prompt_lens=(70,), steps=(24,))
    lone = _engine(model, tok, spec, "q4+fp40", 16)
    (res,) = lone.generate(_requests(lone, prompts, forced))
    want = lone.hooks.logits[res.key]
    eng = _engine(model, tok, spec, "q4+fp40", 16)
    for i in range(4):
        eng.hooks.force(f"s{i}", forced[0])
    results = eng.generate([Request(f"s{i}", prompts[0], SamplingParams(max_tokens=24), group="g")
                            for i in range(4)])
    s = eng.summary()
    assert s["forks"] == 3 and s["prefix_cache"]  # asked for, yet none: no prefix caching with first tokens
    assert s["pages_cached"] == 0  # (a cached prompt would leave its 4 full pages cached)
    for r in results:
        assert r.ok
        for a, b in zip(eng.hooks.logits[r.key], want):
            assert mx.abs(a - b).max().item() <= TOL


def test_gate_refuses_what_is_not_validated(tiny_model):
    """Keys at fewer bits than values (k4v8) are not in the table: refused in one line unless
    kv.allow_unvalidated; kv=none with mode options is refused by the config check."""
    model, tok, spec = tiny_model()
    cfg = engine_config(kv_mode="q4", page_size=16, memory_budget=BUDGET, kv={"value_bits": 8})
    with pytest.raises(KvbatchConfigError) as err:
        Engine(model, tok, spec, cfg)
    assert "\n" not in str(err.value) and "kv=k4v8 is not validated" in str(err.value)
    cfg.kv.allow_unvalidated = True
    eng = Engine(model, tok, spec, cfg)
    (res,) = eng.generate([Request("a", list(range(60, 100)), SamplingParams(max_tokens=30))])
    assert res.ok and (eng.stats()["key_bits"], eng.stats()["value_bits"]) == (4, 8)
    with pytest.raises(KvbatchConfigError, match="kv.value_bits=4: needs a quantized kv.mode"):
        Engine(model, tok, spec, engine_config(kv_mode="none", kv={"value_bits": 4}))


def test_gate_refuses_the_portable_route_in_bfloat16_on_the_cpu(tiny_model):
    """The portable route reads bfloat16 pages in place with gather_mm, which MLX's CPU backend runs on float32
    only: a bfloat16 model there is refused at the start in one line (it used to end every row with
    internal_error); on other backends it runs (float16 on the CPU: test_fp16_huge_scores_stay_finite)."""
    model, tok, spec = tiny_model(dtype="bfloat16")
    portable = EngineOptions(route="portable")
    for mode in ("none", "q8"):
        cfg = engine_config(kv_mode=mode, page_size=16, memory_budget=BUDGET, options=portable)
        if on_cpu():
            with pytest.raises(KvbatchConfigError) as err:
                Engine(model, tok, spec, cfg)
            assert "\n" not in str(err.value) and "set model.dtype=float32" in str(err.value)
            continue
        (res,) = Engine(model, tok, spec, cfg).generate([Request("a", list(range(60, 80)),
                                                                  SamplingParams(max_tokens=8))])
        assert res.ok and len(res.tokens) == 8


def test_gate_refuses_rotation_where_not_validated(tiny_model):
    """kv.rotate_keys is validated where test_mode_matches_stored_pages_reference runs it (llama 64
    and 128, qwen3 128); on llama head 256 (q8/q4 validated, rotation not) it is refused in one line."""
    model, tok, spec = tiny_model(family="llama", head_dim=256)
    assert "q8" in VALIDATED[("llama", 256)] and "rotate_keys" not in VALIDATED[("llama", 256)]
    cfg = engine_config(kv_mode="q8", page_size=16, memory_budget=BUDGET, kv={"rotate_keys": True})
    with pytest.raises(KvbatchConfigError) as err:
        Engine(model, tok, spec, cfg)
    assert "\n" not in str(err.value) and "kv.rotate_keys=True is not validated for llama with head size 256" \
        in str(err.value)
    for fam, hd in GEOMS + (("llama", 128),):
        assert "rotate_keys" in VALIDATED[(fam, hd)]
