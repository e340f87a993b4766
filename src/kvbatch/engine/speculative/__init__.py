"""Speculative decoding: a row's next tokens proposed cheaply, checked by the model in one
verification pass with the rest of the batch (engine/speculative/verify.py).

A proposer is anything with `propose(row, k)`: n-gram lookup in the row's own tokens today
(ngram.py); a draft model or a model's multi-token-prediction heads plug in at the same seam.
"""
from __future__ import annotations

from typing import Optional, Protocol

from kvbatch.engine.config import SpeculativeConfig
from kvbatch.engine.row import Row
from kvbatch.engine.speculative.ngram import NgramProposer


class Proposer(Protocol):
    """Proposes up to k next tokens of a row (deterministic: each proposed token has probability 1)."""

    def propose(self, row: Row, k: int) -> list[int]:
        """Up to k tokens to follow the row's tokens so far ([]: none this step)."""
        ...


def make_proposer(cfg: SpeculativeConfig) -> Optional[Proposer]:
    """The proposer speculative.method names (None: no speculation)."""
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    return None
