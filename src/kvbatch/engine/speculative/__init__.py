"""Speculative decoding: a row's next tokens proposed cheaply, checked by the model in one
verification pass with the rest of the batch (engine/speculative/verify.py).

A proposer is anything with `propose(rows, ks)`: n-gram lookup in each row's own tokens (ngram.py, or
ngram_device.py searching every row at once on the device)
or a draft model's small decode steps over its own paged cache (draft.py); a model's
multi-token-prediction heads plug in at the same seam. Whether a step proposes at all follows what
verifying was measured to pay at the batch size running (payoff.py, speculative.adaptive).
"""
from __future__ import annotations

from typing import Optional, Protocol

from kvbatch.engine.config import SpeculativeConfig
from kvbatch.engine.row import Row
from kvbatch.engine.speculative.ngram import NgramProposer
from kvbatch.engine.speculative.ngram_device import DeviceNgramProposer


class Proposer(Protocol):
    """Proposes up to k next tokens of each of a step's speculating rows."""

    def propose(self, rows: list[Row], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow rows[i]'s tokens so far ([]: none this step)."""
        ...

    def prepare(self, rows: list[Row], proposals: list[list[int]]) -> None:
        """The pass of `rows` with these proposals is in flight: work toward the next proposals that can be
        done before its tokens are read (while the device computes)."""
        ...

    def forget(self, everything: bool = False) -> None:
        """Drop what is kept for rows no longer running (everything: for every row)."""
        ...

    def stats(self) -> dict:
        """The proposer's own figures for summary.json ({} when it has none)."""
        ...


def make_proposer(cfg: SpeculativeConfig) -> Optional[Proposer]:
    """The proposer speculative.method names that needs nothing but the config (ngram); None:
    no speculation, or a draft model (the engine builds its DraftProposer over its own cache)."""
    if cfg.method == "ngram":
        if cfg.ngram_search == "device":
            return DeviceNgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    return None
