"""Speculative decoding (speculative.method=ngram): the same tokens as without it, on tiny random
models (kv none, q8, q4; page sizes 1, 16, 64), with rows joining and leaving, preemption, prefix
caching, n samples and stop rules; rejected tokens never keep a page.

The random models' greedy output settles into runs of one token, so n-gram proposals from the
rows' own tokens fire and are mostly accepted; at a low temperature (or top_k 2 at temperature 1)
the runs break at random, so proposals are also rejected. Sampled rows keep their tokens for a
seed (each position is verified with the key its decode step would use), so every comparison
below is token for token, and each asserts that proposals were accepted (and, sampled, rejected).
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
from kvbatch.engine.grammar import grammar_from_format
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.row import Row
from kvbatch.engine.samples import samples
from kvbatch.engine.runner import TokenPass
from kvbatch.engine.sampling import RowSampler, Sampled, sample_batch
from kvbatch.engine.speculative.ngram import NgramIndex, NgramProposer
from kvbatch.engine.speculative.state import RowSpec
from kvbatch.engine.speculative.verify import accepted_prefix, key_chain
from kvbatch.engine.speculative.window import max_proposal
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request
from tests.conftest import ON_CUDA, ON_CPU

# the mechanism under test, every step: which steps speculate is not left to measured speed (test_payoff.py)
NGRAM = {"method": "ngram", "num_tokens": 4, "adaptive": False}
# how a verification pass runs the rows without a proposal: in the window's padded forward (null) or in a
# one-token forward of their own whenever a pass has both kinds of rows (0); and, IN_FLIGHT, padded with the
# lookahead on (what GPUs run): each pass stays in flight while the next step reads the one before, builds
# the next from its tokens and only then applies its outputs (engine.py _land_pass). The engine tests below
# run all three
IN_FLIGHT = "in flight"
SPLITS = pytest.mark.parametrize("split", [None, 0, IN_FLIGHT], ids=["padded", "split", "in-flight"])


def prompts(n: int = 6) -> list[list[int]]:
    """Prompts with a repeated phrase, so n-gram proposals have something to match."""
    base = [(7 * j) % 50 + 60 for j in range(12)]
    return [base * 3 + [(31 * i + 7 * j) % 256 for j in range(5 + i)] for i in range(n)]


def _engine(m, spec=None, mode="none", page=16, **kw):
    model, tok, mspec = m
    if spec and spec.get("split_pass_tokens") == IN_FLIGHT:
        spec = dict(spec, split_pass_tokens=None)
        kw["options"] = replace(kw.get("options") or EngineOptions(), lookahead="on")
    cfg = engine_config(kv_mode=mode, page_size=page, max_batch=kw.pop("max_batch", 4),
                        memory_budget=kw.pop("memory_budget", 2 << 30), speculative=spec,
                        allow_unvalidated=True, **kw)
    return Engine(model, tok, mspec, cfg)


def _requests(n=6, **sp) -> list[Request]:
    return [Request(f"r{i}", p, SamplingParams(max_tokens=sp.pop("max_tokens", 30) + 5 * i, seed=i, **sp))
            for i, p in enumerate(prompts(n))]


def _both(m, reqs_fn, spec=NGRAM, **kw):
    """Results without and with speculation (same requests, same settings), and the speculating engine."""
    ref = _engine(m, None, **kw).generate(reqs_fn())
    eng = _engine(m, spec, **kw)
    return ref, eng.generate(reqs_fn()), eng


def _same(ref, got):
    for a, b in zip(ref, got):
        assert (a.key, a.tokens, a.text, a.finish_reason, a.stop_reason) == \
            (b.key, b.tokens, b.text, b.finish_reason, b.stop_reason)


# ---- proposals, windows, the sampler -----------------------------------------------------------
def _scan_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The n-gram rule by its definition: the longest suffix (n_max down to n_min tokens) that occurred
    before, its latest earlier occurrence, and up to k tokens after it."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for p in range(L - 2, n - 2, -1):  # p: where an earlier occurrence ends
            if tokens[p - n + 1:p + 1] == tokens[L - n:]:
                return tokens[p + 1:p + 1 + k]
    return []


def _propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    idx = NgramIndex(n_min)
    idx.extend(tokens)
    return idx.propose(k, n_max)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    t = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # suffix (2, 3): latest earlier occurrence at 5..6, followed by 4 5 7
    assert _propose(t, 3, 2, 4) == [4, 5, 7]
    # the 3-gram (7, 2, 3) never occurred before; with n_min 3 nothing is proposed
    assert _propose(t, 3, 3, 4) == []
    assert _propose([5, 6, 7], 2, 1, 2) == []
    # the proposal stops at the sequence's end
    assert _propose([8, 8, 8], 4, 1, 2) == [8]
    # a longer match wins over a later shorter one: (9, 2, 3) at 1..3 against (2, 3) at 6..7
    assert _propose([1, 9, 2, 3, 5, 4, 2, 3, 6, 9, 2, 3], 2, 2, 4) == [5, 4]


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (2, 4), (3, 3), (1, 5)])
def test_ngram_index_extended_step_by_step_proposes_as_a_full_scan(n_min, n_max):
    """The row's index, extended by a few tokens at a time as steps add them, proposes exactly what scanning
    the whole sequence would, after every extension (small vocabularies: many matches, long and short)."""
    rng = np.random.default_rng(n_min * 10 + n_max)
    for vocab in (3, 8, 50):
        toks = rng.integers(0, vocab, 40).tolist()
        toks += toks[5:25]  # a copied stretch, as a rewrite copies its source
        idx = NgramIndex(n_min)
        at = 0
        while at < len(toks):
            step = int(rng.integers(1, 6))
            idx.extend(toks[at:at + step])
            at += step
            for k in (1, 4):
                assert idx.propose(k, n_max) == _scan_propose(toks[:at], k, n_min, n_max), (vocab, at, k)


def _index_state(idx: NgramIndex) -> tuple:
    return list(idx.toks), {k: list(v) for k, v in idx.ends.items()}


def test_ngram_index_cut_back_is_the_index_of_the_tokens_left():
    """truncate(n) leaves exactly the index that extending by the first n tokens builds."""
    rng = np.random.default_rng(7)
    for n_min in (1, 2, 3):
        toks = rng.integers(0, 6, 60).tolist()
        for n in (0, 1, n_min, n_min + 1, 30, 59, 60):
            idx, ref = NgramIndex(n_min), NgramIndex(n_min)
            idx.extend(toks[:25])
            idx.extend(toks[25:])
            idx.truncate(n)
            ref.extend(toks[:n])
            assert _index_state(idx) == _index_state(ref), (n_min, n)


@pytest.mark.parametrize("n_min,n_max,k", [(1, 3, 4), (2, 4, 3), (2, 2, 8)])
def test_ngram_proposals_prepared_in_flight_are_the_proposals_of_the_kept_tokens(n_min, n_max, k):
    """With each pass's next proposals prepared while it is in flight (a guess of the tokens it keeps),
    every proposal equals the one a proposer that never prepares makes from the same tokens, whether the
    pass kept the guessed tokens, fewer, or others; and both paths are taken."""
    rng = np.random.default_rng(n_min * 100 + k)
    src = rng.integers(0, 40, 120).tolist()
    rows, plain_rows = [], []
    for i in range(6):
        prompt, first = src[i * 10:i * 10 + 60], int(rng.integers(0, 40))
        for lst in (rows, plain_rows):
            r = Row(Request(f"r{i}", prompt, SamplingParams(max_tokens=400)), CacheRow(f"r{i}"),
                    RowSampler(SamplingParams()), 500, 0.0, out=[first])
            r.spec = RowSpec()
            lst.append(r)
    prepared, plain = NgramProposer(n_min, n_max), NgramProposer(n_min, n_max)
    for _ in range(60):
        ks = [int(rng.integers(1, k + 1)) for _ in rows]
        props = prepared.propose(rows, ks)
        assert props == plain.propose(plain_rows, ks)
        prepared.prepare(rows, props)
        for row, other, p in zip(rows, plain_rows, props):
            idx = row.spec.ngram
            guess = idx.toks[idx.confirmed:]
            roll = rng.random()
            if guess and roll < 0.6:
                kept = guess  # the pass kept the guessed tokens
            elif p and roll < 0.8:
                kept = p[:int(rng.integers(0, len(p) + 1))] + [int(rng.integers(0, 40))]  # fewer, then its own
            else:
                kept = [int(rng.integers(0, 40))]
            row.out += kept
            other.out += kept
    for row, other in zip(rows, plain_rows):
        prepared.index(row)
        assert _index_state(row.spec.ngram) == _index_state(plain.index(other))
    s = prepared.stats()
    assert 0 < s["ngram_prepared_used"] < s["ngram_prepared"] and plain.stats()["ngram_prepared"] == 0


def test_quantized_window_never_seals_an_unverified_token(tiny_model):
    """q8/q4: the verified window stays in the row's tail page and ends before the page is complete
    (a row whose own token completes it proposes nothing), so a rollback only ever cuts into the
    dense tail page."""
    row = Row(Request("k", [1] * 10, SamplingParams(max_tokens=100)), CacheRow("k"), RowSampler(SamplingParams()),
              110, 0.0, out=[3])
    P = 16
    for length in range(0, 3 * P):
        row.kv.length = length
        k = max_proposal(row, 8, 4096, P, quantized=True)
        last = length + k  # the pass writes positions length..last
        sealed = [b for b in range(P - 1, last + 1, P) if b >= length]  # page ends the pass writes
        assert all(b == length for b in sealed), (length, k)
        assert last // P == length // P, (length, k)  # one page
        assert k == min(8, P - 2 - length % P) if length % P < P - 1 else k == 0
        assert max_proposal(row, 8, 4096, P, quantized=False) == 8
    row.kv.length = 5
    assert max_proposal(row, 8, 4096, 1, quantized=True) == 0  # page size 1: every token seals its page
    assert max_proposal(row, 200, 4096, 16, quantized=False) == 98  # max_tokens: 100 - 1 out - this step's own


def test_row_backs_off_after_failed_proposals():
    s = RowSpec()
    s.verified(4, 0)
    assert s.may_propose()
    s.verified(4, 0)
    assert [s.may_propose() for _ in range(3)] == [False, False, True]
    s.verified(4, 0)
    assert [s.may_propose() for _ in range(5)] == [False] * 4 + [True]
    assert s.want == 1  # nothing accepted: one token next time
    s.verified(4, 2)
    assert s.may_propose() and s.misses == 0 and (s.proposed, s.accepted) == (16, 2) and s.want == 3
    s.verified(3, 3)
    assert s.want == 4  # all accepted: one more


def _chi2_ok(counts: np.ndarray, p: np.ndarray) -> bool:
    """Pearson's chi-square against p, at the 0.1% level (Wilson-Hilferty approximation)."""
    n, df = counts.sum(), len(p) - 1
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    z = 3.09  # upper 0.1%
    return chi2 < df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_verification_at_temperature_1_keeps_the_distribution():
    """The verifier's rule over many draws: a proposed token x is accepted with probability p(x);
    the token a row keeps at that position is distributed as p (accepted x, or the residual).
    Skipping verification (always accepting x) or a biased draw fails it."""
    V, N = 8, 4000
    logits = mx.array(np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02], dtype=np.float32)))
    p = np.exp(np.array(logits))
    params = SamplingParams(temperature=1.0)
    rows = [Row(Request(f"k{i}", [1]), CacheRow("k"), RowSampler(SamplingParams(temperature=1.0, seed=i)), 10, 0.0,
                out=[1]) for i in range(N)]
    x = 1  # the proposal: p(x) = 0.2
    # position 0 (proposal x checked) and position 1 (the bonus after an accepted x), each row's own keys
    keys = [key_chain(r.sampler.key, 2)[0] for r in rows]
    flat_rows = [r for r in rows for _ in range(2)]
    got = sample_batch(mx.broadcast_to(logits, (2 * N, V)), flat_rows, steps=[1, 2] * N,
                       keys=[k for ks in keys for k in ks]).tokens.tolist()
    kept = []
    accepted = 0
    for i in range(N):
        a = accepted_prefix(got[2 * i:2 * i + 2], [x])
        accepted += a
        kept.append(got[2 * i])  # accepted: x itself; else the residual draw
    assert abs(accepted / N - p[x]) < 4 * math.sqrt(p[x] * (1 - p[x]) / N)
    assert _chi2_ok(np.bincount(kept, minlength=V), p)
    rejected = [t for t in kept if t != x]
    resid = p.copy()
    resid[x] = 0
    assert _chi2_ok(np.bincount(rejected, minlength=V), resid / resid.sum() + 1e-12 * (resid == 0))
    # a verifier that skipped the check would keep x every time
    assert not _chi2_ok(np.bincount([x] * N, minlength=V), p)
    assert params.temperature == 1.0


@SPLITS
# ---- the engine: same tokens -----------------------------------------------------------------
@pytest.mark.parametrize("family,mode,page", [("llama", "none", 1), ("llama", "none", 16), ("qwen3", "none", 64),
                                              ("llama", "q8", 16), ("qwen3", "q4", 64), ("qwen3", "q8", 16)])
def test_greedy_tokens_identical(tiny_model, family, mode, page, split):
    """Six rows through four slots (rows join and leave), greedy: the same tokens, and the pool empty after."""
    m = tiny_model(family=family)
    ref, got, eng = _both(m, _requests, spec=dict(NGRAM, split_pass_tokens=split), mode=mode, page=page)
    _same(ref, got)
    s = eng.summary()
    assert s["spec_accepted"] > 0 and sum(r.stats.spec_accepted for r in got) == s["spec_accepted"]
    assert s["pages_in_use"] == 0 and s["rows_running"] == 0
    # in flight: most passes are read a step later, the rest (a slot freeing for a waiting row) at once
    assert (s["spec_passes_in_flight"] > s["spec_passes"] // 2) == (split == IN_FLIGHT)
    # in flight, proposals looked up ahead (NgramProposer.prepare) were used, and the tokens stayed the same
    assert (s["ngram_prepared_used"] > 0) == (split == IN_FLIGHT)


@pytest.mark.parametrize("mode,split", [("none", 0), ("q8", 0), ("none", None), ("none", 2)])
def test_rows_without_a_proposal_decode_beside_the_windows(tiny_model, mode, split):
    """speculative.split_pass_tokens: a verification pass whose rows without a proposal pad at least
    that many positions runs them as a one-token forward (L = 1) and only the proposing rows as the
    window (every row of it proposed); below it (null: always) one forward holds every row. Passes of
    both kinds happen, and the tokens are those without speculation."""
    m = tiny_model()
    ref = _engine(m, None, mode=mode).generate(_requests())
    eng = _engine(m, dict(NGRAM, split_pass_tokens=split), mode=mode)
    verifier, begin = eng.speculator.verifier, eng.cache.begin
    forwards: list[list[tuple[int, list[int]]]] = []
    in_pass = [False]

    def spy_begin(rows, L, poison=None, lens=None):
        if in_pass[0]:
            forwards[-1].append((L, list(lens or [L] * len(rows))))
        return begin(rows, L, poison, lens)

    def spy_step(rows, proposals):
        forwards.append([])
        in_pass[0] = True
        try:
            return step(rows, proposals)
        finally:
            in_pass[0] = False

    step = verifier.step
    eng.cache.begin, verifier.step = spy_begin, spy_step
    _same(ref, eng.generate(_requests()))
    assert eng.summary()["spec_accepted"] > 0
    padding = []  # per pass: positions the rows without a proposal would pad in one forward
    for f in forwards:
        lens = [n for _, ls in f for n in ls]
        padding.append(sum(n == 1 for n in lens) * (max(lens) - 1))
        if len(f) == 2:
            (L1, plain), (L2, window) = f
            assert L1 == 1 and set(plain) == {1} and L2 > 1 and min(window) > 1
        else:
            assert len(f) == 1
    split_passes = [p for f, p in zip(forwards, padding) if len(f) == 2]
    assert eng.summary()["spec_split_passes"] == len(split_passes)  # recorded in summary.json's engine part
    one_forward = [p for f, p in zip(forwards, padding) if len(f) == 1]
    if split is None:
        assert not split_passes and any(one_forward), "rows with and without a proposal shared a forward"
    else:
        assert split_passes and all(p >= split for p in split_passes) and all(p < split or p == 0
                                                                                for p in one_forward)


@pytest.mark.parametrize("mode,page", [("none", 16), ("q8", 16), ("none", 64)])
def test_greedy_tokens_identical_on_the_portable_route(tiny_model, mode, page):
    """engine.options.route=portable (what Metal runs): kv-none verification windows read the pages in
    place, each query over its own keys; the same tokens as without speculation."""
    ref, got, eng = _both(tiny_model(), _requests, mode=mode, page=page, options=EngineOptions(route="portable"))
    _same(ref, got)
    assert eng.summary()["spec_accepted"] > 0


@SPLITS
@pytest.mark.parametrize("mode,page", [("none", 1), ("q8", 16)])
def test_sampled_tokens_identical_with_rejections(tiny_model, mode, page, split):
    """Sampled rows (temperature 1 with top_k 2, and temperature 0.15): the tokens each seed gets
    without speculation, with proposals accepted and rejected."""
    m = tiny_model()

    def reqs():
        out = _requests(3, temperature=1.0, top_k=2)
        return out + [Request(f"t{i}", p, SamplingParams(max_tokens=40, temperature=0.15, seed=10 + i))
                      for i, p in enumerate(prompts(3))]
    ref, got, eng = _both(m, reqs, spec=dict(NGRAM, split_pass_tokens=split), mode=mode, page=page)
    _same(ref, got)
    s = eng.summary()
    assert s["spec_accepted"] > 0 and s["spec_proposed"] > s["spec_accepted"]


def test_output_steps_take_the_tokens_the_pass_read(tiny_model):
    """A verification pass reads its tokens and finite flags once; each output step it hands on carries
    its rows' share of them (TokenPass.read) for the OutputProcessor, which then reads no device array:
    every such share equals what the step's own arrays hold, and verification passes hand on only such
    steps."""
    m = tiny_model()
    eng = _engine(m, NGRAM)
    accept, shares = eng.output.accept, []

    def spy(rows, logits, sampled, finite, read=None):
        if read is not None:
            shares.append((read, (sampled.tokens.tolist(), finite.tolist())))
        return accept(rows, logits, sampled, finite, read)

    eng.output.accept = spy
    eng.generate(_requests(3, temperature=1.0, top_k=2)
                 + [Request(f"g{i}", p, SamplingParams(max_tokens=40)) for i, p in enumerate(prompts(3))])
    s = eng.summary()
    assert s["spec_passes"] > 0 and s["spec_accepted"] > 0
    assert len(shares) >= s["spec_passes"]  # at least one output step a pass, each with its share
    for read, held in shares:
        assert read == held


def test_a_step_whose_tokens_were_read_is_landed_without_reading_the_device(tiny_model):
    """Runner.land waits for a step by reading its tokens, except for a step whose tokens the host holds
    already (a verification pass's output steps): with a pass in flight, those are applied after the next
    pass's dispatch, and reading their gathered arrays would wait for that pass too."""
    eng = _engine(tiny_model(), dict(NGRAM, split_pass_tokens=IN_FLIGHT))

    class Unread:  # a token array that must not be read
        def tolist(self):
            raise AssertionError("the device was read")

    step = TokenPass([], mx.zeros((0, 4)), Sampled(Unread()), mx.zeros((0,), dtype=mx.bool_),  # type: ignore[arg-type]
                     read=([], []))
    eng.runner.land(step)
    step.read = None
    with pytest.raises(AssertionError, match="the device was read"):
        eng.runner.land(step)


@pytest.mark.parametrize("split", [None, IN_FLIGHT], ids=["padded", "in-flight"])
def test_no_page_holds_a_rejected_token_after_a_step(tiny_model, split):
    """Page size 1 (each rejected token had a page of its own): after every step each running row
    holds exactly the pages of its stored tokens, reserves nothing beyond them, and the pool's pages
    in use are the rows' pages and no more. In flight, a row of the pass in flight also holds that
    pass's window (not verified yet), and only it (a plain step in flight: its one token)."""
    m = tiny_model()
    eng = _engine(m, dict(NGRAM, split_pass_tokens=split), page=1, prefix_cache=False)
    for r in _requests(4, temperature=0.15):
        eng.add(r)
    rejected, flown = 0, 0
    while eng.has_unfinished():
        eng.step()
        running = eng.scheduler.running
        sent = eng.speculator.inflight
        window = {id(r): n for r, n in zip(sent.rows, sent.lens)} if sent is not None else {}
        flown += bool(window)
        step = eng.stepper._step if eng.lookahead else None  # a plain step in flight: one token a row
        window.update((id(r), 1) for r in (step.rows if step is not None else ()))
        for row in running:
            if not row.prefilling:
                assert len(row.kv.pages) == row.kv.length == row.kv.reserved == \
                    row.prompt_len + len(row.out) - 1 + window.get(id(row), 0)
        assert eng.cache.pool.in_use == len({p for row in running for p in row.kv.pages})
        s = eng.summary()
        rejected = s["spec_proposed"] - s["spec_accepted"]
    assert rejected > 0 and eng.summary()["pages_in_use"] == 0
    assert (flown > 0) == (split == IN_FLIGHT)


@SPLITS
def test_preemption_mid_speculation_keeps_only_accepted_tokens(tiny_model, split):
    """Optimistic admission in a budget for about two rows: rows are preempted while speculating and
    resume with their accepted tokens only; the same tokens as without speculation."""
    m = tiny_model()
    probe = _engine(m, None, max_batch=6, admission="reserve")
    budget = probe.memory.bytes_for([60 + 60] * 2, 60)

    def reqs():
        return [Request(f"r{i}", p, SamplingParams(max_tokens=60, temperature=0.15, seed=i))
                for i, p in enumerate(prompts(6))]
    ref, got, eng = _both(m, reqs, spec=dict(NGRAM, split_pass_tokens=split), max_batch=6, admission="optimistic",
                          memory_budget=budget)
    _same(ref, got)
    s = eng.summary()
    assert s["preemptions"] > 0 and s["spec_accepted"] > 0 and all(r.ok for r in got)


@SPLITS
def test_prefix_cache_holds_only_accepted_tokens(tiny_model, split):
    """A second wave whose prompts are the first wave's prompts and outputs takes the cached pages
    (including pages of generated tokens) and continues exactly as without speculation."""
    m = tiny_model()

    def run(spec):
        eng = _engine(m, spec, page=16)
        first = eng.generate(_requests(4, temperature=0.15))
        again = [Request(f"b{r.key}", p + r.tokens, SamplingParams(max_tokens=20, temperature=0.15, seed=3))
                 for r, p in zip(first, prompts(4))]
        return first + eng.generate(again), eng.summary()
    (ref, s0), (got, s1) = run(None), run(dict(NGRAM, split_pass_tokens=split))
    _same(ref, got)
    assert s1["prompt_tokens_cached"] == s0["prompt_tokens_cached"] > 0 and s1["spec_accepted"] > 0


@SPLITS
def test_samples_stop_rules_and_logprobs(tiny_model, split):
    """n samples forked from one prefill, a stop string, min_tokens and logprobs: as without speculation."""
    m = tiny_model()
    tok = m[1]

    def reqs():
        ps = prompts(3)
        base = Request("n", ps[0], SamplingParams(max_tokens=30, temperature=0.15, seed=5), group="n")
        out = samples(base, 3)
        # the first row's greedy run token, as text: a stop string met after min_tokens
        out.append(Request("stop", ps[0], SamplingParams(max_tokens=40, stop=(tok.decode([28]) * 3,), min_tokens=6)))
        out.append(Request("lp", ps[2], SamplingParams(max_tokens=25, logprobs=3)))
        out.append(Request("min", ps[0], SamplingParams(max_tokens=25, min_tokens=20, temperature=0.15, seed=9)))
        return out
    ref, got, eng = _both(m, reqs, spec=dict(NGRAM, split_pass_tokens=split))
    _same(ref, got)
    assert got[3].finish_reason == "stop" and len(got[3].tokens) >= 6
    lp_ref, lp_got = ref[4].logprobs, got[4].logprobs
    assert lp_ref is not None and lp_got is not None and len(lp_got.tokens) == len(got[4].tokens)
    assert np.allclose(lp_ref.tokens, lp_got.tokens, atol=1e-4)
    assert [[t for t, _ in top] for top in lp_ref.top] == [[t for t, _ in top] for top in lp_got.top]
    assert eng.summary()["spec_accepted"] > 0


@pytest.mark.parametrize("split", [48, 0])
def test_constrained_and_penalized_rows_beside_speculating_rows(tiny_model, split):
    """Constrained (json_object) and penalized rows never propose; in a verification pass they take part with
    their one token (in the window's forward, or split into a one-token forward of their own) and get what
    they get without speculation, as do the speculating rows beside them."""
    m = tiny_model()

    def reqs():
        out = _requests(3)
        out.append(Request("json", [1, 2, 3], SamplingParams(max_tokens=12, temperature=1.0, seed=4,
                                                             grammar=grammar_from_format("json_object"))))
        out.append(Request("pen", prompts(1)[0], SamplingParams(max_tokens=20, presence_penalty=1.5)))
        return out
    ref, got, eng = _both(m, reqs, spec=dict(NGRAM, split_pass_tokens=split))
    _same(ref, got)
    assert got[3].stats.spec_proposed == got[4].stats.spec_proposed == 0
    assert eng.summary()["spec_accepted"] > 0


def test_a_row_that_never_fits_is_refused(tiny_model):
    m = tiny_model()
    probe = _engine(m, None)
    budget = probe.memory.bytes_for([60 + 40], 60)
    eng = _engine(m, NGRAM, memory_budget=budget)
    res = eng.generate([Request("big", prompts(1)[0], SamplingParams(max_tokens=5000)),
                        Request("ok", prompts(1)[0], SamplingParams(max_tokens=20))])
    assert res[0].error_code == INSUFFICIENT_MEMORY and res[1].ok and len(res[1].tokens) == 20
    # the verification window is priced: the step workspace covers a pass of k + 1 tokens a row with logits at
    # each (on the CPU it is the largest pass; on MLX CUDA a batched prefill pass can be larger still)
    mem, W, vocab = eng.memory, eng.memory.decode_window, m[2].vocab_size
    assert W == 1 + 4 and probe.memory.decode_window == 1
    verification = mem.prefill_pass(64, W, 1000) + 2 * 64 * W * vocab * 4
    assert mem.step_workspace(64, 1000) >= verification
    if ON_CPU:
        assert verification > probe.memory.step_workspace(64, 1000)
    # passes in flight (the lookahead): the pass before keeps its float32 logits while the next one runs
    flying = _engine(m, dict(NGRAM, split_pass_tokens=IN_FLIGHT), memory_budget=budget)
    assert flying.memory.window_in_flight and not mem.window_in_flight
    assert flying.memory.step_workspace(64, 1000) >= verification + 64 * W * vocab * 4


def test_disable_by_batch_size(tiny_model):
    """Above the batch size no row proposes; at or below it they do (and the tokens stay the same)."""
    m = tiny_model()
    ref = _engine(m, None).generate(_requests(4))
    off = _engine(m, {**NGRAM, "disable_by_batch_size": 3})
    on = _engine(m, {**NGRAM, "disable_by_batch_size": 4})
    _same(ref, off.generate(_requests(4)))
    _same(ref, on.generate(_requests(4)))
    assert on.summary()["spec_accepted"] > off.summary()["spec_accepted"]
    # the last rows (fewer than 4 decoding) speculate even under 3
    assert off.summary()["spec_proposed"] < on.summary()["spec_proposed"]


def test_bad_speculative_setting_fails_at_once(tiny_model):
    with pytest.raises(KvbatchConfigError, match="speculative.method"):
        _engine(tiny_model(), {"method": "eagle"})
    with pytest.raises(KvbatchConfigError, match="speculative.prompt_lookup_max"):
        _engine(tiny_model(), {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2})
    with pytest.raises(KvbatchConfigError, match="speculative.split_pass_tokens"):
        _engine(tiny_model(), {"method": "ngram", "split_pass_tokens": -1})


@pytest.mark.parametrize("route,mode,in_place", [("auto", "none", "DenseStep"), ("auto", "q8", "QuantPagedDecode"),
                                                 ("portable", "none", "PortableStep"),
                                                 ("portable", "q8", "PortableQuantStep")])
def test_multi_query_option_decides_how_windows_are_read(tiny_model, route, mode, in_place):
    """The route's multi_query decides how windows are read: with the default, verification windows are
    read in place like decode (the route's decode-kind plan); with 1, every multi-token pass takes the
    prefill path (set on the route: the engine refuses speculation whose windows do not fit
    engine.options.multi_query, the test below). On the CPU in float32 the tokens are the same either way;
    0 is refused in one line."""
    from tests.conftest import kv_cache

    seen: dict[int, set] = {}
    for mq in (8, 1):
        eng = _engine(tiny_model(), NGRAM, mode=mode, options=EngineOptions(route=route))
        attention = kv_cache(eng).attention
        attention.multi_query = mq
        plan, kinds = attention.plan, set()

        def watch(rows, L, pos, lens, plan=plan, kinds=kinds):
            meta = plan(rows, L, pos, lens)
            if 1 < L <= 5 and all(a > 0 for a in pos):  # verification windows (k = 4), no prompt chunk
                name = type(meta).__name__  # a DenseStep with groups: read in place on the CPU
                kinds.add(name + ("+groups" if name == "DenseStep" and getattr(meta, "groups", None) else ""))
            return meta
        attention.plan = watch
        ref = _engine(tiny_model(), None, mode=mode, options=EngineOptions(route=route)).generate(_requests())
        _same(ref, eng.generate(_requests()))
        assert eng.summary()["spec_accepted"] > 0
        seen[mq] = kinds
    if ON_CUDA and route == "auto":  # kv none: the window kernel; q8/q4 windows take the prefill path there
        assert seen[8] == ({"CudaMulti"} if mode == "none" else seen[1]) and "CudaMulti" not in seen[1], seen
    else:
        in_place_kind = in_place + ("+groups" if in_place == "DenseStep" else "")
        assert in_place_kind in seen[8] and in_place_kind not in seen[1], seen
    with pytest.raises(KvbatchConfigError, match="engine.options.multi_query"):
        _engine(tiny_model(), NGRAM, options=EngineOptions(multi_query=0))


def test_windows_wider_than_multi_query_are_refused_and_fit_once_it_is_raised(tiny_model):
    """num_tokens 8 makes windows of 9 tokens: past the default multi_query (8) they would take the prefill
    path, whose rounding differs from decode's, so the setting is refused in one line naming the fix; with
    multi_query 9 the windows read like decode and the tokens are those without speculation."""
    wide = dict(NGRAM, num_tokens=8)
    with pytest.raises(KvbatchConfigError, match=r"speculative.num_tokens=8: .*engine.options.multi_query \(8\)"):
        _engine(tiny_model(), wide)
    ref, got, eng = _both(tiny_model(), _requests, spec=wide, options=EngineOptions(multi_query=9))
    _same(ref, got)
    assert eng.summary()["spec_accepted"] > 0
    _engine(tiny_model(), None)  # without speculation the window never matters
