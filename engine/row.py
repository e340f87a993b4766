"""One row's state inside the engine, from admission to its result."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.sampling import RowSampler
from kvbatch.engine.types import Request


@dataclass(eq=False)
class Row:
    req: Request
    kv: CacheRow
    sampler: RowSampler
    worst: int  # prompt + max_tokens, capped at the context: what admission prices
    t_submit: float
    forced: Optional[list[int]] = None  # hooks: teacher-forced tokens
    out: list[int] = field(default_factory=list)
    t_first: Optional[float] = None
    t_last: Optional[float] = None
    ended: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_tokens)

    def ends_after(self, n: int, context_length: int) -> bool:
        """Whether the row ends once it holds n output tokens, whatever they are."""
        return (n >= self.req.sampling.max_tokens or self.prompt_len + n >= context_length
                or (self.forced is not None and n >= len(self.forced)))
