"""benchmarks/job/ngram_ceiling.py: a plain run's outputs replayed through the n-gram proposer say what
the engine's speculation proposes and accepts, row by row, and the job's steps count as continuous
batching runs them."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)

import random

from benchmarks.job.ngram_ceiling import job_steps, row_passes, row_passes_pipelined
from kvbatch.engine.engine import Engine
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request


def test_replay_under_the_engines_back_off_counts_what_the_engine_counted(tiny_model):
    model, tok, spec = tiny_model()
    base = [(7 * j) % 50 + 60 for j in range(12)]
    prompts = [base * 3 + [(31 * i + 7 * j) % 256 for j in range(5 + i)] for i in range(6)]
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=30 + 5 * i, temperature=0.0))
            for i, p in enumerate(prompts)]
    cfg = engine_config(kv_mode="none", page_size=16, max_batch=4, memory_budget=2 << 30, allow_unvalidated=True,
                        speculative={"method": "ngram", "num_tokens": 4, "adaptive": False})
    results = Engine(model, tok, spec, cfg).generate(reqs)
    assert sum(r.stats.spec_accepted for r in results) > 0
    for req, r in zip(reqs, results):
        steps, proposed, accepted = row_passes(req.prompt_tokens, r.tokens, 4, 2, 4,
                                               backoff=req.sampling.max_tokens)
        assert (proposed, accepted) == (r.stats.spec_proposed, r.stats.spec_accepted), r.key
        assert steps <= len(r.tokens) - 1
    # proposing at every step never takes more steps than the back-off does
    for req, r in zip(reqs, results):
        assert row_passes(req.prompt_tokens, r.tokens, 4, 2, 4)[0] <= \
            row_passes(req.prompt_tokens, r.tokens, 4, 2, 4, backoff=req.sampling.max_tokens)[0]


def test_a_row_that_repeats_its_prompt_takes_a_step_per_window():
    prompt = list(range(100, 140))
    out = list(range(100, 122))  # the output copies the prompt
    steps, proposed, accepted = row_passes(prompt, out, 4, 2, 4)
    # out[0] comes from prefill; the first step's suffix (139, 100) occurred nowhere before, so it proposes
    # nothing and keeps out[1]; from (100, 101) on, each step accepts 4 and keeps 5 tokens: 20 in 4 steps
    assert (steps, proposed, accepted) == (1 + 4, 16, 16)
    assert row_passes(prompt, out, 8, 2, 4)[0] == 1 + 3  # 9 tokens a step: 9, 9, then the last 2


def test_a_pass_behind_guesses_the_token_in_flight():
    """The host a pass behind: each pass's proposal continues the host's guess of the pass in flight's last
    token, so on the copied prompt the row takes one pass more than proposing after every read (its first
    match needs one token more), and wastes none: every guess holds."""
    prompt = list(range(100, 140))
    out = list(range(100, 122))
    # passes: [] (no match), [] (its guess has none either), then 103-106, 108-111, 113-116, 118-120
    assert row_passes_pipelined(prompt, out, 4, 2, 4) == (6, 0, 4 + 4 + 4 + 3)


def test_a_pass_behind_keeps_every_token_and_wastes_a_pass_per_partial_acceptance():
    """On random rows (small vocabularies, copied stretches): every token comes from a pass that ran on the
    right tokens (passes - wasted of them, each giving its accepted tokens and one more), and a pass is
    wasted only after one that kept part of its proposal."""
    rng = random.Random(0)
    wasted = 0
    for _ in range(300):
        vocab = rng.choice([3, 6, 40])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        out += out[:rng.randrange(0, len(out) + 1)]
        passes, w, accepted = row_passes_pipelined(prompt, out, 4, 2, 4)
        assert (passes - w) + accepted == len(out) - 1
        assert passes <= 2 * max(len(out) - 1, 0)
        wasted += w
    assert wasted > 0


def test_job_steps_is_continuous_batching():
    assert job_steps([5, 5, 5], 3) == 5
    assert job_steps([5, 5, 5], 1) == 15
    # two slots: 4 and 2 start; 2 ends at 2 and 3 starts (ends 5); 4 ends at 4 and 1 starts (ends 5)
    assert job_steps([4, 2, 3, 1], 2) == 5
    assert job_steps([], 8) == 0
