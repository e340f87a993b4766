"""Which rows run: the waiting queue, the running batch, admission against the memory model.

Admission prices a row's worst case (prompt + max_tokens) next to the rows already
running; a row that can never fit alone is refused (`insufficient_memory`) before any page
is allocated for it; one that does not fit yet waits for running rows to finish.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from kvbatch.engine import errors
from kvbatch.engine.errors import RowError
from kvbatch.engine.kv_cache import PagedKVCache
from kvbatch.engine.memory import MemoryModel
from kvbatch.engine.row import Row
from kvbatch.engine.types import ModelSpec


class Scheduler:
    def __init__(self, spec: ModelSpec, memory: MemoryModel, cache: PagedKVCache, max_batch: int,
                 page_size: int, max_prompt_tokens: Optional[int]):
        self.spec, self.memory, self.cache = spec, memory, cache
        self.max_batch, self.page_size, self.max_prompt_tokens = max_batch, page_size, max_prompt_tokens
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self.peak_concurrency = 0

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    def next_admission(self) -> Optional[tuple[Row, Optional[tuple[str, str]]]]:
        """The next waiting row that can be decided now: (row, None) = admitted (its cache row
        taken, it is running and must be prefilled); (row, (code, message)) = refused. None:
        nothing more this step (no slot, or the head row must wait for memory)."""
        if not self.waiting or len(self.running) >= self.max_batch:
            return None
        row = self.waiting[0]
        problem = self.refusal(row)
        if problem:
            self.waiting.popleft()
            return row, problem
        if not self.memory.fits([r.worst for r in self.running] + [row.worst],
                                max(r.prompt_len for r in self.running + [row])):
            return None  # waits for running rows to finish
        self.waiting.popleft()
        self.cache.admit(row.kv)
        self.running.append(row)
        self.peak_concurrency = max(self.peak_concurrency, len(self.running))
        return row, None

    def refusal(self, row: Row) -> Optional[tuple[str, str]]:
        req, n = row.req, row.prompt_len
        p = req.sampling
        if n == 0:
            return errors.INVALID_INPUT, "empty prompt (0 tokens)"
        if p.max_tokens < 1:
            return errors.INVALID_INPUT, f"max_tokens must be >= 1, got {p.max_tokens}"
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
            return errors.INVALID_INPUT, f"bad sampling parameters: {p}"
        if any((not isinstance(t, int)) or t < 0 or t >= self.spec.vocab_size for t in req.prompt_tokens):
            return errors.INVALID_INPUT, "prompt has token ids outside the vocabulary"
        # the context must keep room for at least one generated token
        limit = self.spec.context_length - 1
        if self.max_prompt_tokens is not None:
            limit = min(limit, self.max_prompt_tokens)
        if n > limit:
            return errors.PROMPT_TOO_LONG, (f"prompt has {n} tokens; the limit is {limit} "
                                            f"(context {self.spec.context_length})")
        if not self.memory.fits([row.worst], n):
            need = self.memory.bytes_for([row.worst], n)
            return errors.INSUFFICIENT_MEMORY, (f"row needs {need} bytes at worst ({row.worst} tokens) "
                                                f"but the budget is {self.memory.budget}")
        return None

    def pool_want(self) -> int:
        """Pages the running rows can hold at most, together: where pool growth may stop."""
        P = self.page_size
        return sum(-(-r.worst // P) for r in self.running)

    def kv_limit(self) -> int:
        """KV bytes the budget leaves next to the weights and the running rows' workspace."""
        worst = [r.worst for r in self.running] or [1]
        prompt = max((r.prompt_len for r in self.running), default=1)
        return self.memory.budget - self.spec.weights_bytes - self.memory.workspace(len(worst), max(worst), prompt)

    def reserve(self, row: Row, n_tokens: int) -> None:
        """Room for the row's next n_tokens (priced; raises RowError when it cannot fit)."""
        self.cache.reserve(row.kv, n_tokens, self.kv_limit(), self.pool_want())

    def reserve_decode(self, rows: list[Row], refused: Callable[[Row, RowError], None]) -> list[Row]:
        """Room for one more token in each of `rows`, in order; the rows reserved. A row whose
        growth is refused goes to `refused` at once (which may free its pages for the next)."""
        ok = []
        limit, want = self.kv_limit(), self.pool_want()  # once per step: they scan every running row
        for r in rows:
            try:
                self.cache.reserve(r.kv, 1, limit, want)
                ok.append(r)
            except RowError as e:
                refused(r, e)
        return ok
