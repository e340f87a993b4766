"""speculative.ngram_search=device: n-gram proposals searched over the rows' tokens kept on the device
(engine/speculative/ngram_device.py) are the proposals of the host's index, token for token, whatever
rows come and go; and an engine searching there gives the tokens it gives without speculation, with
the proposals (so the counts) of the host search."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.row import Row
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
    ref, got, eng = _both(m, _requests, spec=dict(DEVICE, split_pass_tokens=split), mode=mode)
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
