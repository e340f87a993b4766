"""Where kvbatch meets mlx-lm's model code."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def forward_last(model: nn.Module, tokens: mx.array, cache: list) -> mx.array:
    """Logits of the last position only: skips the vocab projection of every prompt token."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        return model(tokens, cache=cache)[:, -1, :]
    h = inner(tokens, cache=cache)[:, -1:, :]
    head = getattr(model, "lm_head", None)
    out = head(h) if head is not None else inner.embed_tokens.as_linear(h)
    return out[:, -1, :]
