"""benchmarks/job/ngram_ceiling.py: a plain run's outputs replayed through the n-gram proposer say what
the engine's speculation proposes and accepts, row by row, and the job's steps count as continuous
batching runs them."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)

from benchmarks.job.ngram_ceiling import job_steps, row_passes
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


def test_job_steps_is_continuous_batching():
    assert job_steps([5, 5, 5], 3) == 5
    assert job_steps([5, 5, 5], 1) == 15
    # two slots: 4 and 2 start; 2 ends at 2 and 3 starts (ends 5); 4 ends at 4 and 1 starts (ends 5)
    assert job_steps([4, 2, 3, 1], 2) == 5
    assert job_steps([], 8) == 0
