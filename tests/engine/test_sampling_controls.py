"""The sampling controls (issue 24): each one, batched with a value per row, against mlx-lm's own
function applied to each row alone on the same logits; then in the engine on the tiny model.

Penalties follow vLLM (the whole prompt + output for repetition, the whole output for presence and
frequency): mlx-lm's processors with a context window that covers the whole history.
"""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p, make_frequency_penalty,
                                 make_presence_penalty, make_repetition_penalty)

from kvbatch.engine import penalties, sampling
from kvbatch.engine.engine import Engine
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config

V = 300


def _logprobs(B: int, seed: int = 0) -> mx.array:
    x = 3 * mx.random.normal((B, V), key=mx.random.key(seed))
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def test_top_k_min_p_top_p_per_row_equal_mlx_lm():
    lp = _logprobs(4)
    ks, mins, ps = [5, 0, 1, 40], [0.05, 0.0, 0.3, 0.001], [0.5, 0.9, 1.0, 0.2]
    tk, mp = sampling.top_k(lp, ks), sampling.min_p(lp, mins)
    tp = apply_top_p(lp, mx.array(ps)[:, None])  # mlx-lm's own, a p per row
    for i in range(4):
        row = lp[i:i + 1]
        want_k = apply_top_k(row, ks[i]) if ks[i] else row
        want_m = apply_min_p(row, mins[i]) if mins[i] else row
        assert mx.array_equal(tk[i:i + 1], want_k).item(), i
        assert mx.array_equal(mp[i:i + 1], want_m).item(), i
        assert mx.array_equal(tp[i:i + 1], apply_top_p(row, ps[i])).item(), i
    kept = [int(mx.isfinite(tk[i]).sum().item()) for i in range(4)]
    assert kept == [5, V, 1, 40]  # top_k keeps exactly k, 0 keeps all
    assert int(mx.isfinite(mp[2]).sum().item()) < int(mx.isfinite(mp[0]).sum().item()) < V


def test_penalties_per_row_equal_mlx_lm_over_the_whole_history():
    B = 4
    logits = 3 * mx.random.normal((B, V), key=mx.random.key(1))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, 30).tolist() for _ in range(B)]
    outs = [rng.integers(0, V, n).tolist() for n in (25, 0, 40, 12)]
    outs[2][:10] = [7] * 10  # a token output many times (frequency counts it)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.7, repetition_penalty=0.8),
              SamplingParams(frequency_penalty=0.4, presence_penalty=-0.5), SamplingParams()]
    got = penalties.apply(logits, [(i, p, np.unique(prompts[i]), penalties.Counts().read(outs[i], V))
                                   for i, p in enumerate(params) if penalties.used(p)])
    for i, p in enumerate(params):
        want = logits[i:i + 1]
        hist = prompts[i] + outs[i]
        if p.repetition_penalty != 1:
            want = make_repetition_penalty(p.repetition_penalty, len(hist))(mx.array(hist), want)
        if p.presence_penalty and outs[i]:
            want = make_presence_penalty(p.presence_penalty, len(outs[i]))(mx.array(outs[i]), want)
        if p.frequency_penalty and outs[i]:
            want = make_frequency_penalty(p.frequency_penalty, len(outs[i]))(mx.array(outs[i]), want)
        assert mx.allclose(got[i:i + 1], want, atol=1e-5, rtol=0).item(), i
    assert mx.array_equal(got[3], logits[3]).item()  # no penalty: untouched
    assert not mx.allclose(got[0], logits[0]).item() and not mx.allclose(got[2], logits[2]).item()
    drop = (logits[2, 7] - got[2, 7]).item()  # ten times output: presence once, frequency ten times
    assert drop == pytest.approx(-0.5 + 10 * 0.4, abs=1e-5)


def test_a_rows_token_counts_follow_its_tokens_through_appends_cuts_and_replacements():
    """Counts reads only what changed since its last read (a step's token, not the whole answer) and equals a
    count of the whole list after every kind of change a row's tokens see, and after any other."""
    rng = np.random.default_rng(3)
    out, counts = penalties.Tokens(), penalties.Counts()
    for step in range(400):
        kind = step % 9
        if kind in (0, 1, 2, 3):
            out.append(int(rng.integers(0, V + 5)))  # some ids past the vocabulary: never counted
        elif kind == 4:
            out.extend(rng.integers(0, V, int(rng.integers(0, 90))).tolist())  # a verification pass's tokens
        elif kind == 5 and out:
            del out[len(out) - int(rng.integers(0, min(len(out), 5) + 1)):]  # a pass's kept tokens taken back
        elif kind == 6 and out:
            out[int(rng.integers(0, len(out)))] = int(rng.integers(0, V))
        elif kind == 7 and out:
            out.pop(int(rng.integers(0, len(out))))
        elif kind == 8 and out:
            out.insert(int(rng.integers(0, len(out))), int(rng.integers(0, V)))
        want = np.bincount([t for t in out if t < V], minlength=V)
        assert _dense(*counts.read(out, V)).tolist() == want.tolist(), step
    resumed = out.copy()  # another list (a plain one): counted whole
    resumed.append(3)
    assert _dense(*counts.read(resumed, V)).tolist() == np.bincount([t for t in resumed if t < V], minlength=V).tolist()


def _dense(ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Counts by id from (distinct ids, their counts); each id once, every count above 0."""
    assert len(set(ids.tolist())) == len(ids) and (counts > 0).all()
    out = np.zeros(V, dtype=np.int64)
    out[ids] = counts
    return out


def _engine(m, **kw):
    model, tok, spec = m
    return Engine(model, tok, spec, engine_config(memory_budget=2 << 30, page_size=8, max_batch=8, **kw),
                  hooks=kw.pop("hooks", None))


def _greedy(m, prompt, n):
    (res,) = _engine(m).generate([Request("g", prompt, SamplingParams(max_tokens=n))])
    return res.tokens


PROMPT = [(13 * j + 5) % 256 for j in range(11)]


@pytest.mark.parametrize("name,params", [
    ("repetition_penalty", dict(repetition_penalty=1.8)),
    ("presence_penalty", dict(presence_penalty=2.0)),
    ("frequency_penalty", dict(frequency_penalty=1.5)),
])
def test_engine_penalty_steps_equal_mlx_lm_on_the_same_logits(tiny_model, name, params):
    """Each step's token is the argmax of mlx-lm's processor applied to that step's raw logits
    (kept by the logit-capture hook), over the row's history so far; and it changes the output."""
    m = tiny_model()
    hooks = EngineHooks(capture_logits={"r"})
    p = SamplingParams(max_tokens=24, **params)
    (res,) = Engine(*m, engine_config(memory_budget=2 << 30, page_size=8), hooks=hooks).generate(
        [Request("r", PROMPT, p)])
    assert res.ok and len(res.tokens) == 24
    for t, raw in enumerate(hooks.logits["r"]):
        out = res.tokens[:t]
        lg = raw[None]
        if name == "repetition_penalty":
            lg = make_repetition_penalty(p.repetition_penalty, 10 ** 6)(mx.array(PROMPT + out), lg)
        elif out:
            make = make_presence_penalty if name == "presence_penalty" else make_frequency_penalty
            lg = make(params[name], 10 ** 6)(mx.array(out), lg)
        assert mx.argmax(lg[0]).item() == res.tokens[t], t
    assert res.tokens != _greedy(m, PROMPT, 24)


@pytest.mark.parametrize("name,value,keep", [
    ("min_p", 0.5, lambda lp: apply_min_p(lp, 0.5)),
    ("top_k", 3, lambda lp: apply_top_k(lp, 3)),
    ("top_p", 0.3, lambda lp: apply_top_p(lp, 0.3)),
])
def test_engine_filter_samples_only_tokens_mlx_lm_keeps(tiny_model, name, value, keep):
    """At a high temperature every sampled token is one mlx-lm's filter keeps on that step's logits; the
    same seed without the filter strays outside that set. Alone and in a batch with other rows: the same."""
    m = tiny_model()
    runs = {}
    for on in (True, False):
        hooks = EngineHooks(capture_logits={"r"})
        p = SamplingParams(max_tokens=30, temperature=5.0, seed=3, **({name: value} if on else {}))
        others = [Request(f"o{i}", PROMPT[i:], SamplingParams(max_tokens=8 + i, temperature=1.0, seed=i, top_k=i))
                  for i in range(3)] if on else []
        eng = Engine(*m, engine_config(memory_budget=2 << 30, page_size=8), hooks=hooks)
        res = eng.generate([Request("r", PROMPT, p)] + others)[0]
        kept = [keep((raw - mx.logsumexp(raw))[None])[0] for raw in hooks.logits["r"]]
        runs[on] = [bool(mx.isfinite(k[t]).item()) for k, t in zip(kept, res.tokens)]
        if on:
            (alone,) = Engine(*m, engine_config(memory_budget=2 << 30, page_size=8)).generate([Request("r", PROMPT, p)])
            assert alone.tokens == res.tokens
    assert all(runs[True]) and len(runs[True]) == 30
    assert not all(runs[False])


class EosIs:
    """The tiny tokenizer with another token as its EOS (the engine reads `eos_token_ids`)."""

    def __init__(self, tok, eos: int):
        self._tok, self.eos_token_ids = tok, [eos]

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_engine_min_tokens_ignore_eos_stop_reason(tiny_model):
    """stop_token_ids end a row at that token (stop_reason = its id); min_tokens masks it until that many
    tokens; ignore_eos makes EOS an ordinary token. Tiny model: 'EOS' is made the stop token here."""
    m = tiny_model()
    greedy = _greedy(m, PROMPT, 40)
    j = next(j for j in range(2, 40) if greedy[j] not in greedy[:j])
    stop = greedy[j]
    hooks = EngineHooks(capture_logits={"min"})
    model, tok, spec = m
    eng = Engine(model, EosIs(tok, stop), spec, engine_config(memory_budget=2 << 30, page_size=8), hooks=hooks)
    by = {r.key: r for r in eng.generate([
        Request("eos", PROMPT, SamplingParams(max_tokens=40)),
        Request("ids", PROMPT, SamplingParams(max_tokens=40, stop_token_ids=(stop,))),
        Request("min", PROMPT, SamplingParams(max_tokens=40, min_tokens=j + 5)),
        Request("ign", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)),
    ])}
    assert by["eos"].tokens == greedy[:j] and by["eos"].stop_reason is None
    assert by["ids"].tokens == greedy[:j] and by["ids"].stop_reason == str(stop)
    assert by["ign"].tokens == greedy and by["ign"].finish_reason == "length" and stop in by["ign"].tokens
    mins = by["min"].tokens
    assert len(mins) >= j + 5 and stop not in mins[:j + 5] and mins[:j] == greedy[:j]
    for t, raw in enumerate(hooks.logits["min"][:j + 5]):  # argmax with the EOS masked, step by step
        assert mins[t] == mx.argmax(raw.at[stop].add(-mx.inf)).item()
