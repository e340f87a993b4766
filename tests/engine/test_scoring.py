"""Teacher-forced scoring (engine/scoring.py, issue 27): kv=none against itself scores KL 0 and top-1
agreement 1; a cache whose stored pages are corrupted scores a large KL (the metric can fail); a quantized
cache scores what decode steps teacher-forced through the same cache give (the page-aligned prefill
reproduces decode's view of the pages), on the tiny model."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.engine import Engine
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.scoring import ForcedRow, compare, groups, score, summarize
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config
from tests.conftest import kv_cache

PAGE = 16


def _engine(m, mode="none", hooks=None, max_batch=4):
    return Engine(*m, engine_config(kv_mode=mode, page_size=PAGE, memory_budget=2 << 30, max_batch=max_batch,
                                    allow_unvalidated=True), hooks)


def _rows(m, n_rows=5, new=40):
    """Prompts of several lengths (some past a page) and kv=none's greedy text for each."""
    prompts = [[(13 * i + 7 * j + 2) % 256 for j in range(n)] for i, n in enumerate((5, 21, 9, 37, 16)[:n_rows])]
    eng = _engine(m)
    res = eng.generate([Request(f"r{i}", p, SamplingParams(max_tokens=new)) for i, p in enumerate(prompts)])
    assert all(r.ok and len(r.tokens) > PAGE for r in res)
    return [ForcedRow(r.key, p, r.tokens) for r, p in zip(res, prompts)]


def test_none_against_itself_is_exact_and_scores_every_position(tiny_model):
    m = tiny_model()
    rows = _rows(m)
    q = compare(_engine(m), {"none": _engine(m)}, rows)["none"]
    assert sorted(q) == [r.key for r in rows]
    for r in rows:
        s = q[r.key]
        assert s.error_code is None and s.positions == len(r.text)
        assert s.kl_mean == 0.0 and s.kl_max == 0.0 and s.top1_agreement == 1.0
        assert s.nll == s.nll_reference > 0
    job = summarize(list(q.values()))
    assert job["tf_positions"] == sum(len(r.text) for r in rows) and job["tf_kl_mean"] == 0.0
    assert job["tf_ppl"] == job["tf_ppl_baseline"] > 1


class CorruptPages(EngineHooks):
    """After every prefill pass, the stored K/V pages are overwritten with noise: each later chunk reads
    garbage where its earlier pages should be."""

    engine = None

    def on_prefill_chunk(self, key, done, total):
        st = kv_cache(self.engine).store
        for i in range(len(st.k)):
            st.k[i] = mx.random.normal(st.k[i].shape, key=mx.random.key(i)).astype(st.k[i].dtype) * 4
            st.v[i] = mx.random.normal(st.v[i].shape, key=mx.random.key(99 + i)).astype(st.v[i].dtype) * 4
        mx.eval(st.k, st.v)


def test_corrupted_pages_give_a_large_kl(tiny_model):
    m = tiny_model()
    rows = _rows(m)
    hooks = CorruptPages()
    bad = _engine(m, hooks=hooks)
    hooks.engine = bad
    job = summarize(list(compare(_engine(m), {"bad": bad}, rows)["bad"].values()))
    assert job["tf_kl_mean"] > 0.05 and job["tf_top1_agreement"] < 0.9, job
    assert job["tf_ppl"] > job["tf_ppl_baseline"]


def _log_softmax(x):
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scoring_equals_decode_teacher_forced_through_the_same_cache(tiny_model, family):
    """The page-aligned prefill gives each text token the view of the cache a decode step has: its KL,
    top-1 and log-probabilities equal those of decode steps fed the same tokens (hooks.force)."""
    m = tiny_model(family=family)
    rows = _rows(m)
    q = compare(_engine(m), {"q4": _engine(m, "q4")}, rows)["q4"]

    def forced(mode):
        hooks = EngineHooks()
        eng = _engine(m, mode, hooks)
        for r in rows:
            hooks.force(r.key, r.text)
        eng.generate([Request(r.key, r.prompt, SamplingParams(max_tokens=len(r.text))) for r in rows])
        return {k: _log_softmax(mx.stack(v)) for k, v in hooks.logits.items()}

    ref, got = forced("none"), forced("q4")
    kls = []
    for r in rows:
        lp, lq = ref[r.key], got[r.key]
        kl = (mx.exp(lp) * (lp - lq)).sum(axis=-1)
        same = (mx.argmax(lp, axis=-1) == mx.argmax(lq, axis=-1)).astype(mx.float32).mean().item()
        s = q[r.key]
        nll = -mx.take_along_axis(lq, mx.array(r.text)[:, None], axis=-1).mean().item()
        # within float noise: a key computed in a prefill pass and in a decode step can differ by 1e-7,
        # which now and then moves a quantized element by one step (tests/engine/kv_reference.py)
        assert s.kl_mean == pytest.approx(kl.mean().item(), rel=2e-2), r.key
        assert s.kl_max == pytest.approx(kl.max().item(), rel=5e-2), r.key
        assert s.top1_agreement == pytest.approx(same) and s.nll == pytest.approx(nll, abs=1e-4)
        kls.append(s.kl_mean)
    assert max(kls) > 1e-6  # q4 is measurably not none: the comparison above is not 0 == 0


def test_groups_bound_the_kept_reference():
    rows = [ForcedRow(str(i), [1], [1] * n) for i, n in enumerate((10, 10, 30, 5, 5))]
    assert [[r.key for r in g] for g in groups(rows, 100, 100 * 4 * 20)] == [["0", "1"], ["2"], ["3", "4"]]


def test_a_row_the_engine_refuses_is_reported_not_scored(tiny_model):
    m = tiny_model()
    rows = _rows(m, n_rows=2) + [ForcedRow("bad", [5, 400], [1, 2, 3])]  # a token outside the vocabulary
    eng = _engine(m)
    out = score(eng, rows, reference=score(_engine(m), rows, keep=True))
    assert out["bad"].quality("bad").error_code == "invalid_input"
    assert out["r0"].quality("r0").error_code is None


# kv none: float tolerance; q8/q4: the bounds the KV-quant tests allow a step that meets a one-step
# rounding flip of a stored element (tests/engine/test_kv_quant.py, test_batched_prefill.py)
TOL = {"none": 1e-4, "q8": 10e-4, "q4": 170e-4}


@pytest.mark.parametrize("mode", ["none", "q8", "q4"])
def test_text_logprobs_equal_mlx_lm_single_stream(tiny_model, mode):
    """Each text token's log-probability (what action=score writes) equals mlx-lm's single-stream model
    fed the same tokens through its own KVCache (q8/q4: kv_reference's QuantRefCache, the pages sealed
    before each call quantize->dequantized), log-softmax in float64; the sum too."""
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from tests.engine.kv_reference import QuantRefCache, teacher_forced_logits

    m = tiny_model()
    model = m[0]
    rows = _rows(m, n_rows=3)
    eng = _engine(m, mode)
    got = score(eng, rows)
    k_axis = eng.stats()["kv_k_axis"] or "token"
    bits = {"q8": 8, "q4": 4}.get(mode)

    def caches(quantized=True):
        if bits is None or not quantized:
            return [KVCache() for _ in model.layers]
        return [QuantRefCache(PAGE, bits, 64, k_axis) for _ in model.layers]

    def reference(r, quantized=True):
        logits = np.stack([np.asarray(x, dtype=np.float64)
                           for x in teacher_forced_logits(model, r.prompt, r.text, lambda: caches(quantized))])
        top = logits.max(axis=-1, keepdims=True)
        return (logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[np.arange(len(r.text)),
                                                                                          r.text]

    off_none = 0.0
    for r in rows:
        lp, mine = reference(r), got[r.key].token_logprobs()
        assert mine is not None and len(mine) == len(r.text)
        assert np.abs(np.array(mine) - lp).max() <= TOL[mode], r.key
        assert sum(mine) == pytest.approx(float(lp.sum()), abs=TOL[mode]), r.key
        off_none = max(off_none, float(np.abs(np.array(mine) - reference(r, quantized=False)).max()))
    if bits:  # the quantized cache is measurably not kv none: the comparison above is not none against none
        assert off_none > 1e-4
