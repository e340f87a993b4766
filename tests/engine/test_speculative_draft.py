"""Speculative decoding with a draft model (speculative.method=draft): the same tokens as without it.

Two drafts of the tiny random llama: the model itself (its proposals are the model's own tokens:
every one accepted, several per verification, greedy and sampled alike, since a sampled proposal
is drawn with the Gumbel noise the model's draw at that position uses), and a one-layer llama of
another seed (proposals accepted and rejected). kv none and q8, page sizes 1 and 16, six rows
through four slots (rows join and leave), preemption mid-row, n samples and the prefix cache,
rows stopped and continued from checkpoints; the draft's pages all given back at the end.
"""
from __future__ import annotations

import math
from dataclasses import replace

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.errors import INSUFFICIENT_MEMORY, KvbatchConfigError
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.row import Row
from kvbatch.engine.samples import samples
from kvbatch.engine.sampling import RowSampler, sample_batch
from kvbatch.engine.speculative.verify import accepted_prefix, key_chain
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request
from tests.engine.test_speculative import _chi2_ok, _same, prompts

DRAFT = {"method": "draft", "num_tokens": 4, "adaptive": False}  # every step, as NGRAM


@pytest.fixture(scope="module")
def models(tiny_model):
    """(target, {"self": the target as its own draft, "other": a one-layer llama of another seed})."""
    m = tiny_model()
    return m, {"self": m, "other": tiny_model(seed=1, num_layers=1)}


def _engine(m, draft=None, mode="none", page=16, spec=DRAFT, **kw):
    model, tok, mspec = m
    cfg = engine_config(kv_mode=mode, page_size=page, max_batch=kw.pop("max_batch", 4),
                        memory_budget=kw.pop("memory_budget", 2 << 30), speculative=spec if draft else None,
                        allow_unvalidated=True, **kw)
    return Engine(model, tok, mspec, cfg, draft=draft)


def _requests(n=6, **sp) -> list[Request]:
    mt = sp.pop("max_tokens", 30)
    return [Request(f"r{i}", p, SamplingParams(max_tokens=mt + 5 * i, seed=i, **sp)) for i, p in enumerate(prompts(n))]


def _both(models, which, reqs_fn, **kw):
    m, drafts = models
    ref = _engine(m, None, **kw).generate(reqs_fn())
    eng = _engine(m, drafts[which], **kw)
    got = eng.generate(reqs_fn())
    _same(ref, got)
    s = eng.summary()
    assert s["pages_in_use"] == 0 and eng.speculator is not None
    assert eng.speculator.proposer.cache.pool.in_use == 0  # type: ignore[attr-defined]
    return got, s


@pytest.mark.parametrize("which,mode,page", [("self", "none", 1), ("other", "none", 16), ("self", "q8", 16),
                                             ("other", "q8", 16)])
def test_greedy_tokens_identical(models, which, mode, page):
    got, s = _both(models, which, _requests, mode=mode, page=page)
    assert s["spec_proposed"] > 0 and sum(r.stats.spec_accepted for r in got) == s["spec_accepted"]
    if which == "self":  # every proposal accepted, several tokens a verification
        assert s["spec_accepted"] == s["spec_proposed"] and s["spec_accepted"] > 2 * s["spec_passes"]


@pytest.mark.parametrize("which", ["self", "other"])
def test_sampled_tokens_identical(models, which):
    """Temperature 1 (and 1 with top_k 2): each seed's tokens; the model as its own draft has every sampled
    proposal accepted (the same noise), the other draft has proposals accepted and rejected."""
    def reqs():
        return _requests(3, temperature=1.0) + _requests(3, temperature=1.0, top_k=2)[::-1]
    _, s = _both(models, which, reqs, mode="none", page=16)
    if which == "self":
        assert s["spec_accepted"] == s["spec_proposed"] > 0
    else:
        assert 0 < s["spec_accepted"] < s["spec_proposed"]


@pytest.mark.parametrize("which,mode", [("self", "none"), ("other", "q8")])
def test_passes_in_flight_keep_the_tokens(models, which, mode):
    """With the lookahead (what GPUs run) each verification pass stays in flight while the host applies the
    one before (engine.py _land_pass): the draft proposes from each row's tokens as they stand then, and
    greedy and sampled rows keep the tokens they get without speculation."""
    def reqs():
        return _requests(3) + _requests(3, temperature=1.0, top_k=2)[::-1]
    _, s = _both(models, which, reqs, mode=mode, page=16, options=EngineOptions(lookahead="on"))
    assert s["spec_accepted"] > 0 and s["spec_passes_in_flight"] > s["spec_passes"] // 2


def test_preemption_mid_row(models):
    """A budget for about two rows, optimistic admission: rows are preempted while speculating, their draft
    pages given back (their full pages cached while the pool keeps them), and rebuilt when they resume; the
    tokens stay the same."""
    m, _ = models
    probe = _engine(m, models[1]["other"], max_batch=6, admission="reserve")
    budget = probe.memory.bytes_for([60 + 60] * 2, 60)

    def reqs():
        return [Request(f"r{i}", p, SamplingParams(max_tokens=60, temperature=0.15, seed=i))
                for i, p in enumerate(prompts(6))]
    got, s = _both(models, "other", reqs, max_batch=6, admission="optimistic", memory_budget=budget)
    assert s["preemptions"] > 0 and s["spec_accepted"] > 0 and all(r.ok for r in got)


def test_samples_prefix_cache_and_checkpoints(models):
    """n samples forked from one prefill and a second wave taking the first wave's cached pages; then rows
    stopped mid-way and continued from checkpoints by a fresh engine: each the tokens of a run without
    speculation (a forked, cached or resumed row has no draft pages: it catches up by prefilling the draft)."""
    m, drafts = models

    def wave1():
        return samples(Request("n", prompts(1)[0], SamplingParams(max_tokens=30, temperature=0.7, seed=5),
                               group="n"), 3) + _requests(2, temperature=0.15)

    ref_eng, eng = _engine(m, None), _engine(m, drafts["self"])
    ref, got = ref_eng.generate(wave1()), eng.generate(wave1())
    _same(ref, got)
    again = [Request(f"b{r.key}", prompts(1)[0] + r.tokens, SamplingParams(max_tokens=20, seed=3)) for r in ref[:3]]
    _same(ref_eng.generate(again), eng.generate(again))
    s = eng.summary()
    assert s["prompt_tokens_cached"] == ref_eng.summary()["prompt_tokens_cached"] > 0
    assert s["spec_accepted"] == s["spec_proposed"] > 0
    assert eng.speculator is not None and eng.speculator.proposer.cached_tokens > 0  # type: ignore[attr-defined]
    # stopped after 40 tokens, continued by a new engine
    first = _engine(m, drafts["other"])
    reqs = _requests(4, temperature=0.15)
    for r in reqs:
        first.add(r)
    done = {}
    while first.generated_tokens < 40:
        done.update((res.key, res) for res in first.step())
    kept = first.checkpoints()
    first.cancel()
    assert kept and first.speculator is not None and first.speculator.proposer.cache.pool.in_use == 0  # type: ignore
    second = _engine(m, drafts["other"])
    for r in reqs:
        if r.key not in done:
            second.add(r, checkpoint=kept.get(r.key))
    done.update((res.key, res) for res in second.run())
    _same(_engine(m, None).generate(reqs), [done[r.key] for r in reqs])
    assert second.summary()["spec_accepted"] > 0


def test_draft_is_priced_and_checked(models):
    """The memory model counts the draft's weights and a draft page beside each page; a row that fits
    without the draft but not with it is refused; a draft with another vocabulary fails in one line."""
    m, drafts = models
    # the same verification window without a draft (ngram): what the draft adds is the difference
    plain, eng = _engine(m, drafts["other"], spec={"method": "ngram", "adaptive": False}), _engine(m, drafts["other"])
    d_spec = drafts["other"][2]
    assert eng.memory.weights_bytes == m[2].weights_bytes + d_spec.weights_bytes
    assert eng.memory.page_bytes == plain.memory.page_bytes + eng.memory.draft.layout.page_bytes  # type: ignore
    plan = eng.plan(200, 100)
    assert plan["weights_bytes"] == eng.memory.weights_bytes and plan["kv_bytes_per_token"] > \
        plain.plan(200, 100)["kv_bytes_per_token"]
    prompt = prompts(1)[0]
    worst = len(prompt) + 200
    budget = plain.memory.bytes_for([worst], len(prompt))
    assert eng.memory.bytes_for([worst], len(prompt)) > budget
    res = _engine(m, drafts["other"], memory_budget=budget).generate(
        [Request("big", prompt, SamplingParams(max_tokens=200))])
    assert res[0].error_code == INSUFFICIENT_MEMORY
    other = drafts["other"]
    with pytest.raises(KvbatchConfigError, match=r"^speculative.model='tiny': its vocabulary has 320 ids"):
        _engine(m, (other[0], other[1], replace(other[2], vocab_size=320)))
    with pytest.raises(KvbatchConfigError, match=r"^speculative.method='draft': no draft model"):
        Engine(*m, engine_config(speculative=DRAFT))


def test_coupled_draft_draws_keep_the_distribution():
    """At temperature 1 the draft draws its proposal x from q with the Gumbel noise the model's draw y from
    p uses at that position; the verifier keeps y (x accepted when x == y). Over many keys the kept tokens
    are distributed as p, the acceptance rate is far above drawing x independently (sum p q) and at most the
    best any verifier can reach (sum min(p, q)); keeping the draft's token instead fails the test."""
    V, N = 8, 4000
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02], dtype=np.float32)
    q = np.array([0.1, 0.3, 0.2, 0.05, 0.15, 0.05, 0.1, 0.05], dtype=np.float32)
    rows = [Row(Request(f"k{i}", [1]), CacheRow("k"), RowSampler(SamplingParams(temperature=1.0, seed=i)), 10, 0.0,
                out=[1]) for i in range(N)]
    keys = [key_chain(r.sampler.key, 1)[0][0] for r in rows]

    def draw(probs):
        logits = mx.broadcast_to(mx.array(np.log(probs)), (N, V))
        return np.array(sample_batch(logits, rows, steps=[1] * N, keys=keys).tokens.tolist())
    x, y = draw(q), draw(p)
    kept = y  # the verifier's token at the position: the model's own draw
    accepted = np.array([accepted_prefix([int(b)], [int(a)]) for a, b in zip(x, y)])
    assert _chi2_ok(np.bincount(kept, minlength=V), p)
    assert _chi2_ok(np.bincount(x, minlength=V), q)  # the draft's proposals are draws from q
    rate, indep, best = accepted.mean(), float((p * q).sum()), float(np.minimum(p, q).sum())
    sd = math.sqrt(best * (1 - best) / N)
    assert indep + 10 * sd < rate <= best + 4 * sd, (rate, indep, best)
    # a verifier that kept the draft's token whenever it proposed one would give q, not p
    assert not _chi2_ok(np.bincount(x, minlength=V), p)


def test_forced_acceptance_hook(models):
    """EngineHooks.force_acceptance (the cost benchmark's): at 0 nothing is accepted yet rows propose k tokens
    every step (no back-off) and keep the model's tokens; at 0.5 each verification keeps half of each proposal;
    at 1 every proposal, the rows ending at max_tokens all the same."""
    m, drafts = models
    ref = _engine(m, None).generate(_requests(3))

    def run(share):
        model, tok, mspec = m
        cfg = engine_config(page_size=16, max_batch=4, memory_budget=2 << 30, speculative=DRAFT)
        eng = Engine(model, tok, mspec, cfg, hooks=EngineHooks(force_acceptance=share), draft=drafts["other"])
        return eng.generate(_requests(3)), eng.summary()
    got, s = run(0.0)
    _same(ref, got)
    assert s["spec_accepted"] == 0 and s["spec_proposed"] >= 4 * (s["spec_passes"] - 3)
    got, s = run(0.5)
    assert 0.4 * s["spec_proposed"] <= s["spec_accepted"] <= 0.5 * s["spec_proposed"]
    got, s = run(1.0)
    assert s["spec_accepted"] == s["spec_proposed"] > 0
    assert [len(r.tokens) for r in got] == [len(r.tokens) for r in ref] and all(r.ok for r in got)
