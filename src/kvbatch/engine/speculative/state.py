"""A row's speculation state: what it proposed and had accepted, and its back-off."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from kvbatch.engine.speculative.ngram import NgramIndex

# A row whose proposals were all rejected this many times in a row stops proposing for a while:
# 2, 4, ... up to MAX_PAUSE steps, doubling at each further miss; one accepted token resets it.
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE = 64


@dataclass
class RowSpec:
    """Per-row counters (results' spec_proposed / spec_accepted) and the back-off that keeps a row
    whose proposals keep failing from paying for their verification."""

    proposed: int = 0
    accepted: int = 0
    misses: int = 0  # verifications in a row with nothing accepted
    pause: int = 0  # steps left without proposing
    # tokens to propose next: one more than the last verification accepted, or one more than
    # last time when all were accepted (so a row pays for positions it is likely to keep)
    want: int = 1 << 30
    ngram: Optional["NgramIndex"] = None  # ngram: the row's tokens and where their n-grams end

    def may_propose(self) -> bool:
        """Whether the row proposes this step (a paused row counts the step down)."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def verified(self, proposed: int, accepted: int) -> None:
        """Count one verification of `proposed` tokens, `accepted` of them kept."""
        self.proposed += proposed
        self.accepted += accepted
        self.want = proposed + 1 if accepted == proposed else accepted + 1
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.pause = min(2 ** (self.misses - MISSES_BEFORE_PAUSE + 1), MAX_PAUSE)
