"""Forward passes and sampling: prefill passes over several rows' prompt chunks, and decode
steps run by one of two steppers.

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
from kvbatch.engine.grammar import Grammars
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.logprobs import prompt_tokens
from kvbatch.engine.mlx_lm_bridge import pick_last, forward_hidden, forward_last
from kvbatch.engine.output import OutputProcessor
from kvbatch.engine.row import Row
from kvbatch.engine.sampling import Sampled, sample_batch
from kvbatch.engine.scheduler import Scheduler


@dataclass
class StepTimes:
    """Where the engine's time went: prefill and decode seconds and tokens."""

    prefill_time: float = 0.0
    prefill_tokens: int = 0
    prefill_passes: int = 0
    prefill_rows_max: int = 0  # most rows in one prefill pass
    decode_time: float = 0.0
    decode_tokens: int = 0
    t_accepted: float = 0.0  # lookahead: when the host last read a step (decode time restarts there)


class Runner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, sched: Scheduler, output: OutputProcessor,
                 hooks: EngineHooks, budget: int, grammars: Optional[Grammars] = None):
        self.model, self.cache, self.sched, self.output, self.hooks = model, cache, sched, output, hooks
        self.grammars = grammars
        self.budget = budget
        self.times = StepTimes()
        self.flush = lambda: None  # lands a decode step in flight (set by the engine to its stepper's)

    def poison(self, rows: list[Row], ahead: frozenset = frozenset()) -> Optional[list[bool]]:
        """hooks.nonfinite: which rows get NaN attention this step. ahead: rows with one token in
        flight (their next output step is len(out) + 1)."""
        inj = self.hooks.nonfinite
        if not inj:
            return None
        return [r.req.key == inj[0] and len(r.out) + (id(r) in ahead) == int(inj[1]) for r in rows]

    def prefill(self, batch: list[tuple[Row, int]]) -> None:
        """One prefill pass: each (row, n) stores the row's next n prompt tokens, the chunks
        right-padded to the longest (ragged: each row at its own position, over its own pages).
        A row whose prompt is complete gets its first token. A row that fails alone ends with its
        error; a pass of several rows that fails is run again row by row, so a fault stays with
        the row that causes it."""
        for row, _ in batch:
            if row.kv.length == 0:
                self.hooks.on_row_start(row.req.key)
        t0 = time.perf_counter()
        ready = []
        for row, n in batch:
            if not row.active:  # preempted to make room for a row before it in this pass
                continue
            try:
                if self.sched.make_room(row, n, self.flush):
                    ready.append((row, n))
            except RowError as e:
                self.output.end(row, "error", e.code, e.message)
        batch = [(row, n) for row, n in ready if row.active]
        if not batch:
            return
        rows, lens = [row for row, _ in batch], [n for _, n in batch]
        L, before = max(lens), [row.kv.length for row in rows]
        try:
            inputs = mx.array([row.prefill_tokens(n) + [0] * (L - n) for row, n in batch])
            last = [row.kv.length + n == row.target for row, n in batch]
            self.cache.begin([row.kv for row in rows], L, self.poison(rows), lens)
            try:
                h, head = forward_hidden(self.model, inputs, self.cache.views)
                scores = self._prompt_scores(batch, before, h, head)
                forced = [a for j, (row, n) in enumerate(batch) if row.score is not None
                          for a in row.score.take(before[j], h[j, :n], head)]
                logits = head(pick_last(h, None if L == min(lens) else mx.array(lens) - 1))[:, -1, :]
                done = [i for i, f in enumerate(last) if f]
                if done:
                    logits = (logits if len(done) == len(rows) else logits[mx.array(done)]).astype(mx.float32)
                    finite = mx.isfinite(logits).all(axis=-1)
                    mx.eval(logits, finite, *[a for _, a in scores], *forced, self.cache.store.all_arrays())
                else:
                    mx.eval(*[a for _, a in scores], *forced, self.cache.store.all_arrays())
            finally:
                self.cache.end()
        except Exception as e:
            for row, n in zip(rows, before):
                row.kv.length = n  # nothing of the failed pass counts as stored
            if len(batch) > 1:
                for one in batch:
                    self.prefill([one])
                return
            self.output.end(rows[0], "error", errors.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
            return
        for row, a in scores:
            row.logprobs.prompt.extend(a.tolist())
        for row, _ in batch:
            self.hooks.on_prefill_chunk(row.req.key, min(row.kv.length, row.prompt_len), row.prompt_len)
        self.times.t_accepted = time.perf_counter()  # lookahead: decode time restarts after a prefill
        self.times.prefill_time += self.times.t_accepted - t0
        self.times.prefill_tokens += sum(lens)
        self.times.prefill_passes += 1
        self.times.prefill_rows_max = max(self.times.prefill_rows_max, len(rows))
        self.trim_cache()
        if done:
            self._first_tokens([rows[i] for i in done], logits, finite)

    def _first_tokens(self, rows: list[Row], logits: mx.array, finite: mx.array) -> None:
        """Rows whose prompt a pass completed: their first tokens. A row with finite logits has its
        full pages cached (prefix caching) and its waiting samples forked (they sample their first
        token from the same logits, each with its own random stream)."""
        ok, out, pick = finite.tolist(), list(rows), list(range(len(rows)))
        for i, row in enumerate(rows):
            if ok[i]:
                forks = self.sched.sharing.prompt_done(row)
                for f in forks:
                    self.hooks.on_row_start(f.req.key)
                out += forks
                pick += [i] * len(forks)
        if len(out) > len(rows):
            at = mx.array(pick)
            logits, finite = logits[at], finite[at]
        token = sample_batch(logits, out, self.grammars)
        mx.eval(*token.arrays())
        self.output.accept(out, logits, token, finite)

    def _prompt_scores(self, batch: list[tuple[Row, int]], before: list[int], h: mx.array,
                       head) -> list[tuple[Row, mx.array]]:
        """prompt_logprobs: (row, lazy log-probabilities of the prompt tokens this pass's chunk predicts)
        for the rows that ask and are not scored yet (a row resumed after a preemption was)."""
        out = []
        for j, (row, n) in enumerate(batch):
            lp, start = row.logprobs, before[j]
            if lp is None or lp.prompt is None or len(lp.prompt) >= row.prompt_len - 1:
                continue
            del lp.prompt[start:]  # a row preempted mid-prompt prefills from its start again
            m = min(n, row.prompt_len - 1 - start)
            if m > 0:
                out.append((row, prompt_tokens(h[j, :m], head, row.req.prompt_tokens[start + 1:start + 1 + m])))
        return out

    def forward_sample(self, rows: list[Row], inputs: mx.array,
                       ahead: frozenset = frozenset()) -> tuple[mx.array, Sampled, mx.array]:
        """One decode forward of (B, 1) inputs, lazily: float32 logits, sampled tokens, finite flags."""
        logits = forward_last(self.model, inputs, self.cache.views).astype(mx.float32)
        return logits, sample_batch(logits, rows, self.grammars, ahead), mx.isfinite(logits).all(axis=-1)

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
        rows = r.sched.reserve_decode(r.sched.decoding(), lambda row, e: out.end(row, "error", e.code, e.message),
                                      self.flush)
        if not rows:
            return
        t0 = time.perf_counter()
        inputs = mx.array([[row.out[-1]] for row in rows])
        try:
            r.cache.begin([row.kv for row in rows], 1, r.poison(rows))
            try:
                logits, tokens, finite = r.forward_sample(rows, inputs)
                mx.eval(*tokens.arrays(), finite)
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

    def flush(self) -> None:
        """Land any step in flight (none here)."""


@dataclass
class _Inflight:
    """A decode step dispatched to the device whose tokens the host has not read yet."""

    rows: list[Row]
    logits: mx.array
    sampled: Sampled
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

    def flush(self) -> None:
        """Land the step in flight (before a preemption frees pages its rows hold)."""
        if self._step is not None:
            step, self._step = self._step, None
            self._accept(step)

    def _last(self, row: Row) -> bool:
        """Whether the row's in-flight token ends it whatever that token is (see OutputProcessor.accept)."""
        return row.ends_after(len(row.out) + 1, self.context_length)

    def step(self) -> None:
        r, out = self.r, self.r.output
        prev = self._step
        ahead = frozenset(id(row) for row in prev.rows) if prev else frozenset()
        if prev is not None and r.sched.waiting and any(self._last(row) for row in prev.rows):
            # a slot frees with this step: read it now, so the waiting row joins the next step
            self.flush()
            return
        candidates = [row for row in r.sched.decoding() if not (id(row) in ahead and self._last(row))]
        refused: list = []  # ended after the in-flight token is accepted
        rows = r.sched.reserve_decode(candidates, lambda row, e: refused.append((row, e)), self.flush)
        prev, self._step = self._step, None  # None if a preemption landed it
        if prev is None:
            ahead = frozenset()
        failed = None
        if rows:
            t0 = time.perf_counter()
            try:
                inputs = self._next_inputs(rows, prev, ahead)
                r.cache.begin([row.kv for row in rows], 1, r.poison(rows, ahead))
                try:
                    logits, tokens, finite = r.forward_sample(rows, inputs, ahead)
                    mx.async_eval(*tokens.arrays(), finite)
                finally:
                    r.cache.end()
                self._step = _Inflight(rows, logits, tokens, finite, t0)
            except Exception as e:
                failed = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        if prev is not None:
            self._accept(prev)  # waits for that step only; the next one keeps the device busy
        if self._step is not None and any(row.sampler.needs_host for row in rows):
            self.flush()  # a grammar or penalty row: its next step needs this token on the host first
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
        step.sampled.tokens.tolist()
        now = time.perf_counter()
        t.decode_time += now - max(step.t0, t.t_accepted)
        t.t_accepted = now
        t.decode_tokens += sum(not row.ended for row in step.rows)
        self.r.trim_cache()
        self.r.output.accept(step.rows, step.logits, step.sampled, step.finite)

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
            return prev.sampled.tokens[:, None]
        idx = mx.array([max(i, 0) for i in pick])
        prev_tokens = prev.sampled.tokens
        tok = mx.where(mx.array([i >= 0 for i in pick]), prev_tokens[idx], mx.array(host, dtype=prev_tokens.dtype))
        return tok[:, None]
