"""Per-row sampling over a batch of logits.

Each row has its own seeded key, split once per step, so a row's samples depend
only on its seed and step, never on which rows share its batch. Filtering uses
mlx-lm's top-k / top-p pieces on log-probabilities, as mlx-lm's own sampler does.
"""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from kvbatch.engine.types import SamplingParams


class RowSampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.greedy = params.temperature <= 0
        self._key = None if self.greedy else mx.random.key(params.seed)

    def sample(self, logits: mx.array) -> mx.array:
        """logits: (V,) float32 -> scalar token (lazy)."""
        p = self.params
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < p.top_k < logits.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        if 0 < p.top_p < 1:
            logprobs = apply_top_p(logprobs, p.top_p)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1 / p.temperature), key=sub)


def sample_batch(logits: mx.array, samplers: list[RowSampler]) -> mx.array:
    """logits (B, V) float32 -> tokens (B,), greedy rows by one argmax."""
    tokens = mx.argmax(logits, axis=-1)
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if sampled:
        picks = {i: samplers[i].sample(logits[i]) for i in sampled}
        tokens = mx.stack([picks[i] if i in picks else tokens[i] for i in range(len(samplers))])
    return tokens
