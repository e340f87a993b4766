"""speculative.ngram_search=device: n-gram proposals searched over the rows' tokens kept on the device
(engine/speculative/ngram_device.py) are the proposals of the host's index, token for token, whatever
rows come and go; and an engine searching there gives the tokens it gives without speculation, with
the proposals (so the counts) of the host search."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.row import Row
from kvbatch.engine.samples import samples
from kvbatch.engine.sampling import RowSampler
from kvbatch.engine.speculative.ngram import NgramProposer
from kvbatch.engine.speculative.ngram_device import DeviceNgramProposer, ngram_search
from kvbatch.engine.speculative.state import RowSpec
from kvbatch.engine.types import Request
from tests.engine.test_speculative import IN_FLIGHT, NGRAM, _both, _engine, _requests, _same, _scan_propose, prompts

DEVICE = dict(NGRAM, ngram_search="device")


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (2, 4), (3, 3), (1, 5)])
def test_search_proposes_as_a_full_scan(n_min, n_max):
    """Rows of every length from 1 token, small vocabularies (many matches, long and short) and copied
    stretches, searched together in one array: each row's proposal is the rule's, for k 1 and 4."""
    rng = np.random.default_rng(n_min * 10 + n_max)
    seqs = []
    for vocab in (3, 8, 50):
        toks = rng.integers(0, vocab, 40).tolist()
        toks += toks[5:25]  # a copied stretch, as a rewrite copies its source
        seqs += [toks[:n] for n in range(1, len(toks) + 1)]
    width = max(map(len, seqs)) + 7  # slots longer than their rows hold stale tokens past them
    hist = mx.array([s + rng.integers(0, 3, width - len(s)).tolist() for s in seqs], dtype=mx.int32)
    lens = mx.array([len(s) for s in seqs], dtype=mx.int32)
    for k in (1, 4):
        _, after = ngram_search(hist, lens, n_min, n_max, k)
        got = [[t for t in row if t >= 0] for row in after.tolist()]
        assert got == [_scan_propose(s, k, n_min, n_max) for s in seqs], k
        assert any(got) and not all(got)


def _row(i: int, prompt: list[int]) -> Row:
    r = Row(Request(f"r{i}", prompt, SamplingParams(max_tokens=400)), CacheRow(f"r{i}"),
            RowSampler(SamplingParams()), 500, 0.0)
    r.spec, r.active = RowSpec(), True
    return r


def test_histories_follow_rows_that_come_and_go():
    """Rows growing a few tokens a step, leaving (their slots taken by new rows, whose tokens replace
    longer stale ones), coming back after a preemption and losing their last tokens (stored again each
    time): every step the device's
    proposals are the host index's, as the histories grow in slots and in tokens."""
    rng = np.random.default_rng(7)
    src = rng.integers(0, 12, 400).tolist()
    device, host = DeviceNgramProposer(2, 4), NgramProposer(2, 4)
    pairs: list[tuple[Row, Row]] = []
    made = 0
    for step in range(80):
        while len(pairs) < 5 + step // 10:  # more rows as the job goes: the slots grow
            at = int(rng.integers(0, 200))
            prompt = src[at:at + int(rng.integers(1, 90))]
            pairs.append((_row(made, prompt), _row(made, prompt)))
            made += 1
        rows, others = [a for a, _ in pairs], [b for _, b in pairs]
        ks = [int(rng.integers(1, 5)) for _ in rows]
        props = device.propose(rows, ks)
        assert props == host.propose(others, ks), step
        for (a, b), p in zip(pairs, props):
            kept = p[:int(rng.integers(0, len(p) + 1))] + [int(rng.integers(0, 12))]
            a.out += kept
            b.out += kept
        if step % 13 == 6:  # a row's tokens taken back (engine.py _read_pass), then others in their place
            a, b = pairs[-1]
            cut = len(a.out) - 2
            del a.out[cut:], b.out[cut:]
        if step % 7 == 3:  # a row ends: its slot goes back and the next new row takes it
            a, _ = pairs.pop(int(rng.integers(0, len(pairs))))
            a.ended = True
        preempted = step % 11 == 5  # a row leaves the batch for a step: stored again when it proposes next
        pairs[0][0].active = not preempted
        device.forget()
        assert set(device.rows) == {id(a) for a, _ in pairs[preempted:]}
        pairs[0][0].active = True
    assert device.hist.shape[1] > 128 and device.hist.shape[0] >= len(pairs)
    device.forget(everything=True)
    assert not device.rows and len(device.free) == device.slots


@pytest.mark.parametrize("mode,split", [("none", None), ("none", IN_FLIGHT), ("q8", IN_FLIGHT), ("q4", 0)],
                         ids=["none-padded", "none-in-flight", "q8-in-flight", "q4-split"])
def test_engine_tokens_and_counts_as_the_host_search(tiny_model, mode, split):
    """Six rows through four slots, greedy: the tokens of decoding without speculation, and exactly the
    host search's proposals (the same counts proposed and accepted, pass for pass)."""
    m = tiny_model()
    # (unchained: a chained pass verifies windows of its own width; tests of chained passes below)
    ref, got, eng = _both(m, _requests, spec=dict(DEVICE, split_pass_tokens=split, chain=False), mode=mode)
    _same(ref, got)
    host = _engine(m, dict(NGRAM, split_pass_tokens=split), mode=mode)
    _same(ref, host.generate(_requests()))
    s, h = eng.summary(), host.summary()
    assert s["spec_accepted"] > 0 and s["pages_in_use"] == 0
    assert (s["spec_proposed"], s["spec_accepted"], s["spec_passes"]) == \
        (h["spec_proposed"], h["spec_accepted"], h["spec_passes"])
    assert (s["ngram_search"], h["ngram_search"]) == ("device", "host")  # summary.json's engine says which ran


def test_preempted_rows_continue_with_their_tokens_stored_again(tiny_model):
    """Optimistic admission in a budget for about two rows: preempted rows give their slots back and store
    their tokens again when they propose next; the same tokens as without speculation."""
    m = tiny_model()
    probe = _engine(m, None, max_batch=6, admission="reserve")
    budget = probe.memory.bytes_for([60 + 60] * 2, 60)

    def reqs():
        return [Request(f"r{i}", p, SamplingParams(max_tokens=60, seed=i)) for i, p in enumerate(prompts(6))]
    ref, got, eng = _both(m, reqs, spec=DEVICE, max_batch=6, admission="optimistic", memory_budget=budget)
    _same(ref, got)
    s = eng.summary()
    assert s["preemptions"] > 0 and s["spec_accepted"] > 0 and all(r.ok for r in got)


def test_unknown_search_fails_at_once(tiny_model):
    with pytest.raises(KvbatchConfigError, match="speculative.ngram_search"):
        _engine(tiny_model(), dict(DEVICE, ngram_search="gpu"))



# ---- chained passes (speculative/chain.py) ------------------------------------------------------
# passes in flight with the device search: each pass built on the device from the one before it, unread.
# A one-token lookup finds a proposal nearly everywhere, and many are rejected
CHAINED = dict(DEVICE, split_pass_tokens=IN_FLIGHT, prompt_lookup_min=1, prompt_lookup_max=2)


def _greedy(n: int = 7, max_tokens: int = 40, **sp) -> list[Request]:
    """Greedy rows of random tokens from a narrow range (so n-grams recur), of several lengths."""
    rng = np.random.default_rng(3)
    return [Request(f"r{i}", rng.integers(60, 70, 40 + 7 * i).tolist(), SamplingParams(max_tokens=max_tokens + 9 * i,
                                                                                          **sp)) for i in range(n)]


@pytest.mark.parametrize("family,mode,page,route", [("llama", "none", 1, "auto"), ("llama", "none", 16, "auto"),
                                                    ("qwen3", "none", 64, "auto"), ("qwen3", "none", 4, "auto"),
                                                    ("llama", "none", 16, "portable"), ("llama", "q8", 16, "auto")])
def test_chained_passes_keep_the_tokens(tiny_model, family, mode, page, route):
    """Seven greedy rows through four slots (rows join and leave), proposals accepted and rejected: the tokens
    of decoding without speculation (and of the unchained host search), each row's counts adding up to the
    engine's, every page back at the end; kv none chains most passes, on the CPU's route and the portable one
    (a quantized cache has no chained plan: its passes run unchained)."""
    m = tiny_model(family=family)
    opts = EngineOptions(route=route)
    ref, got, eng = _both(m, _greedy, spec=CHAINED, mode=mode, page=page, options=opts)
    _same(ref, got)
    host = _engine(m, dict(CHAINED, ngram_search="host"), mode=mode, page=page, options=opts)
    _same(ref, host.generate(_greedy()))
    s, h = eng.summary(), host.summary()
    assert s["pages_in_use"] == 0 and 0 < s["spec_accepted"] < s["spec_proposed"]
    assert sum(r.stats.spec_accepted for r in got) == s["spec_accepted"]
    assert sum(r.stats.spec_proposed for r in got) == s["spec_proposed"]
    assert h["spec_passes_chained"] == 0
    if mode == "none":
        assert s["spec_passes_chained"] > s["spec_passes"] // 2
    else:
        assert s["spec_passes_chained"] == 0


def test_chain_off_builds_each_pass_after_the_one_before_is_read(tiny_model):
    """speculative.chain=false: the device search's passes are built after the pass before is read, none chained,
    and the tokens are the chained run's; summary.json's engine says whether passes chain."""
    m = tiny_model()
    chained = _engine(m, CHAINED)
    a = chained.generate(_greedy())
    off = _engine(m, dict(CHAINED, chain=False))
    _same(a, off.generate(_greedy()))
    s, o = chained.summary(), off.summary()
    assert s["spec_passes_chained"] > 0 and s["spec_chain"] is True
    assert o["spec_passes_chained"] == 0 and o["spec_chain"] is False and o["spec_passes_in_flight"] > 0
    assert o["spec_accepted"] > 0


def test_chained_pass_rows_hold_only_kept_tokens_and_its_window(tiny_model):
    """Page size 1, greedy: after every step each running row holds exactly the pages of its stored tokens and
    of the window of the pass in flight (for a chained pass: its whole k + 1), reserves nothing beyond them,
    and the pool's pages in use are the rows' pages and no more."""
    eng = _engine(tiny_model(), CHAINED, page=1, prefix_cache=False)
    for r in _greedy(5):
        eng.add(r)
    chained = 0
    while eng.has_unfinished():
        eng.step()
        sent = eng.speculator.inflight
        assert eng.speculator.older is None  # the pass a chained one was built from is read in the same step
        window = {id(r): n for r, n in zip(sent.rows, sent.lens)} if sent is not None else {}
        step = eng.stepper._step  # a plain step in flight: one token a row
        window.update((id(r), 1) for r in (step.rows if step is not None else ()))
        for row in eng.scheduler.running:
            if not row.prefilling:
                assert len(row.kv.pages) == row.kv.length == row.kv.reserved == \
                    row.prompt_len + len(row.out) - 1 + window.get(id(row), 0)
        assert eng.cache.pool.in_use == len({p for row in eng.scheduler.running for p in row.kv.pages})
        chained = eng.summary()["spec_passes_chained"]
    s = eng.summary()
    assert chained > 10 and s["spec_proposed"] > s["spec_accepted"] and s["pages_in_use"] == 0


def test_rows_that_finish_their_prompt_join_the_next_pass(tiny_model):
    """Prompts prefilled a chunk at a time (rows reach decode at different steps, while the others' passes
    are chained): after every step each decoding row with tokens to go is in the pass or step in flight, so
    no row waits for the chained passes of the rows before it (but one near its max_tokens, which sits out a
    step while the pass that may end it is read); the tokens are those without speculation."""
    m = tiny_model()

    def reqs():
        return _greedy(8, max_tokens=30)
    ref, eng = _engine(m, None, max_batch=8).generate(reqs()), _engine(m, CHAINED, max_batch=8, prefill_chunk=24,
                                                                       prefill_tokens=48)
    for r in reqs():
        eng.add(r)
    got: list = []
    while eng.has_unfinished():
        got += eng.step()
        sent, step = eng.speculator.inflight, eng.stepper._step
        flying = {id(r) for r in (sent.rows if sent is not None else ())} | \
            {id(r) for r in (step.rows if step is not None else ())}
        near_end = 2 * (CHAINED["num_tokens"] + 1)
        for row in eng.scheduler.running:
            if not row.prefilling and not row.ended and len(row.out) + near_end <= row.end_at:
                assert id(row) in flying, f"{row.req.key} decodes in no pass"
    _same(ref, sorted(got, key=lambda r: int(r.key[1:])))
    s = eng.summary()  # rows joining and rows near their end do not break the chain
    assert s["spec_passes_chained"] > 3 * s["spec_passes"] // 4


def test_chained_passes_through_preemption_prefix_cache_samples_and_stops(tiny_model):
    """Greedy rows in a budget for about two (optimistic admission: rows preempted while passes are chained,
    resuming with their kept tokens), a second wave continuing the first's outputs from the prefix cache, n
    samples, a stop string past min_tokens, logprobs, and a sampled row (never chained) beside them: the
    results of decoding without speculation."""
    m = tiny_model()
    tok = m[1]
    probe = _engine(m, None, max_batch=6, admission="reserve")
    budget = probe.memory.bytes_for([60 + 60] * 2, 60)

    def run(spec):
        eng = _engine(m, spec, max_batch=6, admission="optimistic", memory_budget=budget)
        first = eng.generate(_greedy(6, max_tokens=60))
        s0 = eng.summary()
        again = [Request(f"b{r.key}", q.prompt_tokens + r.tokens, SamplingParams(max_tokens=20))
                 for r, q in zip(first[:3], _greedy(3))]
        base = Request("n", _greedy(1)[0].prompt_tokens, SamplingParams(max_tokens=30), group="n")
        more = samples(base, 3) + [
            Request("stop", prompts(1)[0], SamplingParams(max_tokens=40, stop=(tok.decode([28]) * 3,), min_tokens=6)),
            Request("lp", prompts(2)[1], SamplingParams(max_tokens=30, logprobs=2)),
            Request("t", prompts(3)[2], SamplingParams(max_tokens=30, temperature=0.7, seed=4))]
        return first + eng.generate(again + more), s0, eng.summary()
    (ref, _, r1), (got, s0, s1) = run(None), run(CHAINED)
    _same(ref, got)
    lp_ref, lp_got = next(r.logprobs for r in ref if r.key == "lp"), next(r.logprobs for r in got if r.key == "lp")
    assert lp_ref is not None and lp_got is not None
    assert np.allclose(lp_ref.tokens, lp_got.tokens, atol=1e-4)  # a window's logits round as decode's nearly
    assert [[t for t, _ in top] for top in lp_ref.top] == [[t for t, _ in top] for top in lp_got.top]
    assert next(r for r in got if r.key == "stop").finish_reason == "stop"
    assert s0["preemptions"] > 0 and s0["spec_passes_chained"] > 0 and all(r.ok for r in got[:6])
    assert [(r.ok, r.error_code) for r in got] == [(r.ok, r.error_code) for r in ref]
    assert s1["prompt_tokens_cached"] == r1["prompt_tokens_cached"] > 0
