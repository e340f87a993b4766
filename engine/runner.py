"""Forward passes and sampling: a row's prefill, and decode steps run by one of two steppers.

`SyncStepper` runs a decode step and reads its tokens before the next one. `LookaheadStepper`
dispatches the next step before the host reads the previous step's tokens (as mlx-lm's
BatchGenerator does), so a GPU never waits while the host builds a step's graph; it gives the
rows the same tokens, logits and finish reasons (tests/engine/test_lookahead.py). The engine
composes one of them; both use the same Runner, Scheduler and OutputProcessor.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from kvbatch.engine import errors
from kvbatch.engine.errors import RowError
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv_cache import PagedKVCache
from kvbatch.engine.mlx_lm_bridge import forward_last
from kvbatch.engine.output import OutputProcessor
from kvbatch.engine.row import Row
from kvbatch.engine.sampling import sample_batch
from kvbatch.engine.scheduler import Scheduler


@dataclass
class StepTimes:
    """Where the engine's time went: prefill and decode seconds and tokens."""

    prefill_time: float = 0.0
    prefill_tokens: int = 0
    decode_time: float = 0.0
    decode_tokens: int = 0
    t_accepted: float = 0.0  # lookahead: when the host last read a step (decode time restarts there)


class Runner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, sched: Scheduler, output: OutputProcessor,
                 hooks: EngineHooks, prefill_chunk: int, budget: int):
        self.model, self.cache, self.sched, self.output, self.hooks = model, cache, sched, output, hooks
        self.prefill_chunk, self.budget = prefill_chunk, budget
        self.times = StepTimes()

    def poison(self, rows: list[Row], ahead: frozenset = frozenset()) -> Optional[list[bool]]:
        """hooks.nonfinite: which rows get NaN attention this step. ahead: rows with one token in
        flight (their next output step is len(out) + 1)."""
        inj = self.hooks.nonfinite
        if not inj:
            return None
        return [r.req.key == inj[0] and len(r.out) + (id(r) in ahead) == int(inj[1]) for r in rows]

    def prefill(self, row: Row) -> None:
        """The row's prompt in chunks of prefill_chunk tokens, then its first token."""
        self.hooks.on_row_start(row.req.key)
        t0 = time.perf_counter()
        toks, chunk = row.req.prompt_tokens, self.prefill_chunk
        try:
            for start in range(0, len(toks), chunk):
                piece = toks[start:start + chunk]
                self.sched.reserve(row, len(piece))
                self.cache.begin([row.kv], len(piece), self.poison([row]))
                try:
                    logits = forward_last(self.model, mx.array([piece]), self.cache.views)
                    if start + chunk < len(toks):
                        mx.eval(self.cache.store.all_arrays())
                    else:
                        logits = logits.astype(mx.float32)
                        token = sample_batch(logits, [row.sampler])
                        finite = mx.isfinite(logits).all(axis=-1)
                        mx.eval(token, finite)
                finally:
                    self.cache.end()
                self.hooks.on_prefill_chunk(row.req.key, start + len(piece), len(toks))
        except RowError as e:
            self.output.end(row, "error", e.code, e.message)
            return
        except Exception as e:  # confined to this row
            self.output.end(row, "error", errors.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
            return
        self.times.t_accepted = time.perf_counter()  # lookahead: decode time restarts after a prefill
        self.times.prefill_time += self.times.t_accepted - t0
        self.times.prefill_tokens += len(toks)
        self.trim_cache()
        self.output.accept([row], logits, token, finite)

    def forward_sample(self, rows: list[Row], inputs: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """One decode forward of (B, 1) inputs, lazily: float32 logits, sampled tokens, finite flags."""
        logits = forward_last(self.model, inputs, self.cache.views).astype(mx.float32)
        return logits, sample_batch(logits, [r.sampler for r in rows]), mx.isfinite(logits).all(axis=-1)

    def trim_cache(self) -> None:
        """MLX keeps freed buffers in its cache (process memory too; step sizes change every
        step, so it grows): give it back once active + cached would pass the budget."""
        if mx.get_active_memory() + mx.get_cache_memory() > self.budget:
            mx.clear_cache()


class SyncStepper:
    """Decode one step and read its tokens before the next."""

    def __init__(self, runner: Runner):
        self.r = runner

    @property
    def inflight(self) -> bool:
        return False

    def step(self) -> None:
        r, out = self.r, self.r.output
        rows = r.sched.reserve_decode(list(r.sched.running), lambda row, e: out.end(row, "error", e.code, e.message))
        if not rows:
            return
        t0 = time.perf_counter()
        inputs = mx.array([[row.out[-1]] for row in rows])
        try:
            r.cache.begin([row.kv for row in rows], 1, r.poison(rows))
            try:
                logits, tokens, finite = r.forward_sample(rows, inputs)
                mx.eval(tokens, finite)
            finally:
                r.cache.end()
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            for row in rows:
                out.end(row, "error", errors.INTERNAL_ERROR, msg)
            traceback.print_exc()
            return
        r.times.decode_time += time.perf_counter() - t0
        r.times.decode_tokens += len(rows)
        r.trim_cache()
        out.accept(rows, logits, tokens, finite)

    def drop(self) -> None:
        """Forget any step in flight (cancel)."""


@dataclass
class _Inflight:
    """A decode step dispatched to the device whose tokens the host has not read yet."""

    rows: list[Row]
    logits: mx.array
    tokens: mx.array
    finite: mx.array
    t0: float


class LookaheadStepper:
    """Decode with one step in flight. Rows whose in-flight step is known to be their last
    (max_tokens, context, forced tokens) are left out of the next; a row that stops on its token
    (EOS, stop string, non-finite logits) is found one step late: that extra step's output is
    dropped (its K/V went to the row's own pages, released after it in stream order)."""

    def __init__(self, runner: Runner, context_length: int):
        self.r, self.context_length = runner, context_length
        self._step: Optional[_Inflight] = None

    @property
    def inflight(self) -> bool:
        return self._step is not None

    def drop(self) -> None:
        self._step = None  # its tokens are dropped with the rows

    def _last(self, row: Row) -> bool:
        """Whether the row's in-flight token ends it whatever that token is (see OutputProcessor.accept)."""
        return row.ends_after(len(row.out) + 1, self.context_length)

    def step(self) -> None:
        r, out = self.r, self.r.output
        prev, self._step = self._step, None
        ahead = frozenset(id(row) for row in prev.rows) if prev else frozenset()
        if prev is not None and r.sched.waiting and any(self._last(row) for row in prev.rows):
            # a slot frees with this step: read it now, so the waiting row joins the next step
            self._accept(prev)
            return
        candidates = [row for row in r.sched.running if not (id(row) in ahead and self._last(row))]
        refused: list = []  # ended after the in-flight token is accepted
        rows = r.sched.reserve_decode(candidates, lambda row, e: refused.append((row, e)))
        failed = None
        if rows:
            t0 = time.perf_counter()
            try:
                inputs = self._next_inputs(rows, prev, ahead)
                r.cache.begin([row.kv for row in rows], 1, r.poison(rows, ahead))
                try:
                    logits, tokens, finite = r.forward_sample(rows, inputs)
                    mx.async_eval(tokens, finite)
                finally:
                    r.cache.end()
                self._step = _Inflight(rows, logits, tokens, finite, t0)
            except Exception as e:
                failed = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        if prev is not None:
            self._accept(prev)  # waits for that step only; the next one keeps the device busy
        for row, e in refused:
            if not row.ended:
                out.end(row, "error", e.code, e.message)
        if failed:
            self._step = None
            for row in rows:
                if not row.ended:
                    out.end(row, "error", errors.INTERNAL_ERROR, failed)

    def _accept(self, step: _Inflight) -> None:
        t = self.r.times
        step.tokens.tolist()
        now = time.perf_counter()
        t.decode_time += now - max(step.t0, t.t_accepted)
        t.t_accepted = now
        t.decode_tokens += sum(not row.ended for row in step.rows)
        self.r.trim_cache()
        self.r.output.accept(step.rows, step.logits, step.tokens, step.finite)

    def _next_inputs(self, rows: list[Row], prev: Optional[_Inflight], ahead: frozenset) -> mx.array:
        """(B, 1) input tokens: a forced token or a token the host holds, else the row's token
        from the in-flight step (lazy)."""
        host, pick = [], []
        at = {id(row): i for i, row in enumerate(prev.rows)} if prev else {}
        for row in rows:
            forced = row.forced
            if id(row) not in ahead:
                host.append(row.out[-1])
                pick.append(-1)
            elif forced is not None and len(row.out) < len(forced):
                host.append(forced[len(row.out)])
                pick.append(-1)
            else:
                host.append(0)
                pick.append(at[id(row)])
        if all(i < 0 for i in pick):
            return mx.array(host)[:, None]
        if all(i >= 0 for i in pick) and pick == list(range(len(prev.rows))):
            return prev.tokens[:, None]
        idx = mx.array([max(i, 0) for i in pick])
        tok = mx.where(mx.array([i >= 0 for i in pick]), prev.tokens[idx], mx.array(host, dtype=prev.tokens.dtype))
        return tok[:, None]
