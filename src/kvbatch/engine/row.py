"""One row's state inside the engine, from admission to its result."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.penalties import Tokens
from kvbatch.engine.sampling import RowSampler
from kvbatch.engine.types import Logprobs, Request


@dataclass(eq=False)
class Row:
    """One request's state in the engine from admission to its result: cache claim, sampler, tokens out and timings."""

    req: Request
    kv: CacheRow
    sampler: RowSampler
    worst: int  # prompt + max(max_tokens, 0), capped at the context: what `reserve` admission prices
    t_submit: float
    forced: Optional[list[int]] = None  # hooks: teacher-forced tokens
    out: list[int] = field(default_factory=Tokens)  # a Tokens: penalties count only what changed
    target: int = 0  # tokens its prefill stores: the prompt, plus the tokens generated before a preemption
    t_admit: Optional[float] = None  # first admission
    t_first: Optional[float] = None
    t_last: Optional[float] = None
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken from shared pages, not computed (first admission)
    resumed: int = 0  # output tokens it started with, kept from a checkpoint (engine/resume.py)
    kv_file: Optional[Any] = None  # a checkpointed row's K/V pages on disk (kv/offload.py KVFile), read at admission
    restored: int = 0  # tokens whose K/V it loaded from that file instead of prefilling them
    active: bool = False  # in the running batch
    input_ok: bool = False  # its prompt and sampling passed the scheduler's input checks (done once)
    ended: bool = False
    logprobs: Optional[Logprobs] = None  # recorded when the row asks for logprobs or prompt_logprobs
    score: Optional[Any] = None  # a teacher-forced scorer (engine/scoring.py): its text is scored, nothing sampled
    spec: Optional[Any] = None  # speculative decoding's state of the row (engine/speculative/state.py RowSpec)
    adapter: int = 0  # its per-row LoRA adapter's index (engine/lora.py; 0: the base model)
    # output tokens at which it ends whatever they are: max_tokens or the context (what `worst` holds beyond
    # the prompt), or the end of its forced tokens; read for every row at every step, so computed once
    end_at: int = field(init=False)

    def __post_init__(self) -> None:
        self.end_at = self.worst - self.prompt_len
        if self.forced is not None:
            self.end_at = min(self.end_at, len(self.forced))

    @property
    def last_step(self) -> bool:
        """Whether its next token is its last whatever that token is (max_tokens, context, forced tokens)."""
        return len(self.out) + 1 >= self.end_at

    @property
    def prompt_len(self) -> int:
        """Tokens in the request's prompt."""
        return len(self.req.prompt_tokens)

    @property
    def prefilling(self) -> bool:
        """Admitted, and its prompt (plus tokens kept from before a preemption) not all stored yet."""
        return self.kv.length < self.target

    @property
    def seq(self) -> list[int]:
        """Its token sequence: the prompt, then the tokens it generated (a copy when there are any)."""
        return self.req.prompt_tokens + self.out if self.out else self.req.prompt_tokens

    def prefill_tokens(self, n: int) -> list[int]:
        """Its next n tokens to prefill (a resumed row: its generated tokens follow the prompt)."""
        done = self.kv.length
        seq = self.req.prompt_tokens
        if done + n > len(seq):
            seq = seq + self.out
        return seq[done:done + n]
