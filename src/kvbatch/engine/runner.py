"""Forward passes and sampling: prefill passes over several rows' prompt chunks, and decode
steps run by one of two steppers. They run what the Scheduler planned and return what the
passes produced; the engine hands that to the OutputProcessor.

`SyncStepper` runs a decode step and reads its tokens before the next one. `LookaheadStepper`
dispatches the next step before the host reads the previous step's tokens (as mlx-lm's
BatchGenerator does), so a GPU never waits while the host builds a step's graph; it gives the
rows the same tokens, logits and finish reasons (tests/engine/test_lookahead.py). The engine
composes one of them; both use the same Runner.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Container, Optional, Sequence, cast

import mlx.core as mx
import mlx.nn as nn

from kvbatch.engine.backend import device_works
from kvbatch.engine.errors import CacheLost, DeviceFailure
from kvbatch.engine.grammar import Grammars
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.logprobs import prompt_tokens
from kvbatch.engine.lora import Adapters
from kvbatch.engine.mlx_lm_bridge import pick_last, forward_hidden, forward_last
from kvbatch.engine.plan import Chunk, StepTimes
from kvbatch.engine.row import Row
from kvbatch.engine.sampling import Sampled, sample_batch

logger = logging.getLogger(__name__)

__all__ = ["Decoded", "LookaheadStepper", "PrefillPass", "Runner", "StepTimes", "SyncStepper", "TokenPass"]


@dataclass
class TokenPass:
    """A pass's sampled tokens for its rows, lazy until the host reads them (the OutputProcessor's input)."""

    rows: list[Row]
    logits: mx.array
    sampled: Sampled
    finite: mx.array
    t0: float = 0.0  # when a decode step was dispatched
    # the tokens and finite flags as host lists, where the pass has read them already (a verification
    # pass reads all its positions at once): the OutputProcessor then reads nothing from the device
    read: Optional[tuple[list[int], list[bool]]] = None


@dataclass
class PrefillPass:
    """A prefill pass that ran. error: why it failed (a pass of one row: that row's fault);
    done: indexes of the chunks that completed their row's prompt, with those rows' float32
    last-position logits and finite flags (evaluated)."""

    chunks: Sequence[Chunk]
    error: Optional[str] = None
    done: list[int] = field(default_factory=list)
    logits: Optional[mx.array] = None
    finite: Optional[mx.array] = None


@dataclass
class Decoded:
    """What a decode step returns: the steps the host reads now, in order (their outputs go to the
    OutputProcessor in that order), and why the step dispatched failed, if it did."""

    landed: list[TokenPass]
    failed: Optional[str] = None


class Runner:
    """Runs what the Scheduler planned: prefill passes and decode steps through the model, and their sampling."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, hooks: EngineHooks, budget: int,
                 grammars: Optional[Grammars] = None, adapters: Optional[Adapters] = None):
        self.model, self.cache, self.hooks = model, cache, hooks
        self.grammars, self.adapters = grammars, adapters
        self.budget = budget
        self.times = StepTimes()

    def poison(self, rows: list[Row], ahead: Container[int] = frozenset()) -> Optional[list[bool]]:
        """hooks.nonfinite: which rows get NaN attention this step. ahead: rows with one token in
        flight (their next output step is len(out) + 1)."""
        inj = self.hooks.nonfinite
        if not inj:
            return None
        return [r.req.key == inj[0] and len(r.out) + (id(r) in ahead) == int(inj[1]) for r in rows]

    def check_failure(self, message: str) -> None:
        """After a pass failed with `message`: raise DeviceFailure when the device no longer evaluates anything
        (after CUDA's "illegal memory access" every later evaluation in the process fails), CacheLost when the KV
        cache's buffers no longer evaluate (a pass that fails at evaluation leaves its writes holding the failed
        graph, which raises again on every later read). Returns when the failure is the pass's own."""
        if self.hooks.device_faulted or not device_works():
            raise DeviceFailure(message)
        try:
            mx.eval(self.cache.store.all_arrays())
        except Exception:  # noqa: BLE001 - any failure to read the buffers means they are lost
            raise CacheLost(message) from None

    def begin(self, rows: list[Row], length: int, poison: Optional[list[bool] | mx.array],
              lens: Optional[list[int]] = None) -> None:
        """Before a forward pass of `rows` (each `length` positions; `lens`: each row's real ones): the
        cache's views of their pages, and with per-row adapters, which adapter each row uses."""
        self.cache.begin([row.kv for row in rows], length, self._faulted(rows, poison), lens)
        self._select_adapters(rows)

    def begin_chained(self, rows: list[Row], length: int, pos: mx.array, lowest: list[int]) -> bool:
        """`begin` for a chained verification pass (PagedKVCache.begin_chained: positions on the device only);
        False where the cache's route cannot plan one."""
        if not self.cache.begin_chained([row.kv for row in rows], length, pos, lowest,
                                        self._faulted(rows, self.poison(rows))):
            return False
        self._select_adapters(rows)
        return True

    def _faulted(self, rows: list[Row], poison: Optional[list[bool] | mx.array]) -> Optional[list[bool] | mx.array]:
        """The pass's poisoned rows, with the hooks' injected fault (tests: the pass's graph, and so its cache
        writes, fails when evaluated)."""
        fault = self.hooks.on_forward()
        if fault is not None:
            poison = mx.logical_and(mx.array(poison or [False] * len(rows)), fault)
        return poison

    def _select_adapters(self, rows: list[Row]) -> None:
        """With per-row adapters, which adapter each row of the pass uses."""
        if self.adapters is not None:
            self.adapters.select([row.adapter for row in rows])

    # ---- prefill ---------------------------------------------------------------------------
    def prefill(self, chunks: Sequence[Chunk]) -> list[PrefillPass]:
        """One prefill pass: each chunk stores its row's next prompt tokens (pages reserved by the
        Scheduler), the chunks right-padded to the longest (ragged: each row at its own position,
        over its own pages). A pass of several rows that fails is run again row by row, so a fault
        stays with the row that causes it: the passes that ran, in order."""
        for row, _ in chunks:
            if row.kv.length == 0:
                self.hooks.on_row_start(row.req.key)
        return self._passes(chunks)

    def _passes(self, chunks: Sequence[Chunk]) -> list[PrefillPass]:
        t0 = time.perf_counter()
        try:
            out = self._forward_chunks(chunks)
        except Exception as e:
            logger.exception("prefill pass of %d rows failed", len(chunks))
            error = f"{type(e).__name__}: {e}"
            self.check_failure(error)  # a lost device or cache fails every pass alike: no split
            if len(chunks) > 1:  # split to find the row at fault
                return [p for one in chunks for p in self._passes([one])]
            return [PrefillPass(chunks, error=error)]
        self._record(chunks, t0)
        return [out]

    def _forward_chunks(self, chunks: Sequence[Chunk]) -> PrefillPass:
        """The pass's forward, evaluated; on failure nothing of it counts as stored."""
        rows, lens = [c.row for c in chunks], [c.tokens for c in chunks]
        L, before = max(lens), [row.kv.length for row in rows]
        done = [i for i, (row, n) in enumerate(chunks) if row.kv.length + n == row.target]
        try:
            inputs = mx.array([row.prefill_tokens(n) + [0] * (L - n) for row, n in chunks])
            self.begin(rows, L, self.poison(rows), lens)
            try:
                h, head = forward_hidden(self.model, inputs, self.cache.views)
                scores = self._prompt_scores(chunks, before, h, head)
                lazy = [a for _, a in scores]
                lazy += [a for j, (row, n) in enumerate(chunks) if row.score is not None
                         for a in row.score.take(before[j], h[j, :n], head)]
                out = PrefillPass(chunks, done=done)
                if done:
                    logits = head(pick_last(h, None if L == min(lens) else mx.array(lens) - 1))[:, -1, :]
                    out.logits = (logits if len(done) == len(rows) else logits[mx.array(done)]).astype(mx.float32)
                    out.finite = mx.isfinite(out.logits).all(axis=-1)
                    lazy += [out.logits, out.finite]
                mx.eval(*lazy, self.cache.store.all_arrays())
            finally:
                self.cache.end()
        except Exception:
            for row, n in zip(rows, before):
                row.kv.length = n
            raise
        for prompt, a in scores:
            prompt.extend(cast(list[float], a.tolist()))
        return out

    def _record(self, chunks: Sequence[Chunk], t0: float) -> None:
        """A pass that ran: its hooks, its statistics, and MLX's buffer cache trimmed."""
        for row, _ in chunks:
            self.hooks.on_prefill_chunk(row.req.key, min(row.kv.length, row.prompt_len), row.prompt_len)
        t = self.times
        t.t_accepted = time.perf_counter()  # lookahead: decode time restarts after a prefill
        t.prefill_time += t.t_accepted - t0
        t.decode_time += t.dispatch_unread  # a decode step dispatched before this pass: its read will not count it
        t.dispatch_unread = 0.0
        t.prefill_tokens += sum(c.tokens for c in chunks)
        t.prefill_passes += 1
        t.prefill_rows_max = max(t.prefill_rows_max, len(chunks))
        self.trim_cache()

    def first_tokens(self, rows: list[Row], pick: list[int], logits: mx.array, finite: mx.array) -> TokenPass:
        """The first tokens of rows whose prompt a pass completed: rows[i] samples from logits[pick[i]]
        (a sample forked from a row samples from its logits, with its own random stream)."""
        if len(pick) > logits.shape[0]:
            at = mx.array(pick)
            logits, finite = logits[at], finite[at]
        token = sample_batch(logits, rows, self.grammars)
        mx.eval(*token.arrays())
        return TokenPass(rows, logits, token, finite)

    def _prompt_scores(self, chunks: Sequence[Chunk], before: list[int], h: mx.array,
                       head) -> list[tuple[list[float], mx.array]]:
        """prompt_logprobs: (the row's prompt log-probabilities so far, lazy log-probabilities of the
        prompt tokens this pass's chunk predicts)
        for the rows that ask and are not scored yet (a row resumed after a preemption was)."""
        out = []
        for j, (row, n) in enumerate(chunks):
            lp, start = row.logprobs, before[j]
            if lp is None or lp.prompt is None or len(lp.prompt) >= row.prompt_len - 1:
                continue
            del lp.prompt[start:]  # a row preempted mid-prompt prefills from its start again
            m = min(n, row.prompt_len - 1 - start)
            if m > 0:
                out.append((lp.prompt, prompt_tokens(h[j, :m], head, row.req.prompt_tokens[start + 1:start + 1 + m])))
        return out

    # ---- decode ----------------------------------------------------------------------------
    def forward_sample(self, rows: list[Row], inputs: mx.array,
                       ahead: Container[int] = frozenset()) -> tuple[mx.array, Sampled, mx.array]:
        """One decode forward of (B, 1) inputs, lazily: float32 logits, sampled tokens, finite flags."""
        logits = forward_last(self.model, inputs, self.cache.views).astype(mx.float32)
        return logits, sample_batch(logits, rows, self.grammars, ahead), mx.isfinite(logits).all(axis=-1)

    def land(self, step: TokenPass) -> None:
        """The host reads a decode step's tokens (waiting for that step only): its time and tokens counted.
        A step whose tokens were read already (a verification pass's output steps) reads nothing: its
        gathered arrays are queued behind whatever was dispatched since, and reading them would wait for it."""
        t = self.times
        if step.read is None:
            step.sampled.tokens.tolist()
        now = time.perf_counter()
        t.decode_time += now - max(step.t0, t.t_accepted)  # the dispatches since the last read included
        t.t_accepted, t.dispatch_unread = now, 0.0
        t.decode_tokens += sum(not row.ended for row in step.rows)
        self.trim_cache()

    def trim_cache(self) -> None:
        """MLX keeps freed buffers in its cache (process memory too; step sizes change every
        step, so it grows): give it back once active + cached would pass the budget."""
        if mx.get_active_memory() + mx.get_cache_memory() > self.budget:
            mx.clear_cache()
            self.times.cache_clears += 1


class SyncStepper:
    """Decode one step and read its tokens before the next."""

    def __init__(self, runner: Runner):
        self.r = runner

    @property
    def inflight(self) -> bool:
        """Whether a decode step is in flight (never, for this stepper)."""
        return False

    def frees_slot(self) -> bool:
        """Whether a row ends with the step in flight whatever its token (none here)."""
        return False

    def candidates(self, decoding: list[Row]) -> list[Row]:
        """The decoding rows that take part in the next step: all of them."""
        return decoding

    def step(self, rows: list[Row]) -> Decoded:
        """Decode one token of each row (room reserved), evaluated."""
        if not rows:
            return Decoded([])
        r, t0 = self.r, time.perf_counter()
        inputs = mx.array([[row.out[-1]] for row in rows])
        try:
            r.begin(rows, 1, r.poison(rows))
            try:
                logits, tokens, finite = r.forward_sample(rows, inputs)
                mx.eval(*tokens.arrays(), finite)
            finally:
                r.cache.end()
        except Exception as e:
            logger.exception("decode step of %d rows failed", len(rows))
            return Decoded([], f"{type(e).__name__}: {e}")
        return Decoded([TokenPass(rows, logits, tokens, finite, t0)])

    def take(self) -> Optional[TokenPass]:
        """The step in flight, for the host to read (none here)."""
        return None

    def drop(self) -> None:
        """Forget any step in flight (cancel)."""


class InFlight:
    """The ids of a step's rows, as a set built on the first membership test: a step asks only for rows with
    a mask, logprobs or an injected fault, and building it costs ~70 us a step at 1,024 rows."""

    __slots__ = ("rows", "_ids")

    def __init__(self, rows: list[Row]):
        self.rows = rows
        self._ids: Optional[frozenset[int]] = None

    def __contains__(self, key: object) -> bool:
        if self._ids is None:
            self._ids = frozenset(map(id, self.rows))
        return key in self._ids


class LookaheadStepper:
    """Decode with one step in flight. Rows whose in-flight step is known to be their last
    (max_tokens, context, forced tokens) are left out of the next; a row that stops on its token
    (EOS, stop string, non-finite logits) is found one step late: that extra step's output is
    dropped (its K/V went to the row's own pages, released after it in stream order)."""

    def __init__(self, runner: Runner):
        self.r = runner
        self._step: Optional[TokenPass] = None

    @property
    def inflight(self) -> bool:
        """Whether a decode step was dispatched and its tokens not yet read."""
        return self._step is not None

    def drop(self) -> None:
        """Forget the step in flight (its rows are gone)."""
        self._step = None  # its tokens are dropped with the rows

    def take(self) -> Optional[TokenPass]:
        """The step in flight, for the host to read now (before a preemption frees pages its rows hold)."""
        step, self._step = self._step, None
        return step

    def _ending(self) -> list[Row]:
        """The rows of the step in flight that its token ends whatever that token is (see OutputProcessor.accept)."""
        prev = self._step
        return [] if prev is None else [row for row in prev.rows if row.last_step]

    def frees_slot(self) -> bool:
        """Whether a row of the step in flight ends with it whatever its token: with rows waiting,
        the engine reads that step now instead of dispatching another, so they join the next one."""
        return bool(self._ending())

    def candidates(self, decoding: list[Row]) -> list[Row]:
        """The decoding rows that take part in the next step: not those whose in-flight token is their last."""
        ending = {id(row) for row in self._ending()}
        return [row for row in decoding if id(row) not in ending] if ending else decoding

    def step(self, rows: list[Row]) -> Decoded:
        """Dispatch the next step of `rows` (room reserved) and return the step in flight before it
        to be read; the new one stays in flight unless a row needs its token on the host first."""
        r = self.r
        prev, self._step = self._step, None  # None if a preemption landed it
        ahead: Container[int] = InFlight(prev.rows) if prev else frozenset()
        failed = None
        if rows:
            t0 = time.perf_counter()
            try:
                inputs = self._next_inputs(rows, prev)
                r.begin(rows, 1, r.poison(rows, ahead))
                try:
                    logits, tokens, finite = r.forward_sample(rows, inputs, ahead)
                    mx.async_eval(*tokens.arrays(), finite)
                finally:
                    r.cache.end()
                self._step = TokenPass(rows, logits, tokens, finite, t0)
                r.times.dispatch_unread = time.perf_counter() - t0
            except Exception as e:
                failed = f"{type(e).__name__}: {e}"
                logger.exception("decode step of %d rows failed", len(rows))
        landed = [prev] if prev is not None else []  # read first; the new step keeps the device busy
        new = self._step
        if new is not None and any(row.sampler.needs_host for row in rows):
            self._step = None  # a grammar or penalty row: its next step needs this token on the host
            landed.append(new)
        return Decoded(landed, failed)

    def _next_inputs(self, rows: list[Row], prev: Optional[TokenPass]) -> mx.array:
        """(B, 1) input tokens: a forced token or a token the host holds, else the row's token
        from the in-flight step (lazy)."""
        if prev is not None and rows == prev.rows and all(row.forced is None for row in rows):
            return prev.sampled.tokens[:, None]  # the same rows as the step in flight: its tokens as they are
        host, pick = [], []
        at = {id(row): i for i, row in enumerate(prev.rows)} if prev else {}  # rows with a token in flight
        for row in rows:
            forced, i = row.forced, at.get(id(row), -1)
            if i < 0:
                host.append(row.out[-1])
                pick.append(-1)
            elif forced is not None and len(row.out) < len(forced):
                host.append(forced[len(row.out)])
                pick.append(-1)
            else:
                host.append(0)
                pick.append(i)
        if all(i < 0 for i in pick):
            return mx.array(host)[:, None]
        assert prev is not None  # a row's token from the step in flight
        if all(i >= 0 for i in pick) and pick == list(range(len(prev.rows))):
            return prev.sampled.tokens[:, None]
        idx = mx.array([max(i, 0) for i in pick])
        prev_tokens = prev.sampled.tokens
        tok = mx.where(mx.array([i >= 0 for i in pick]), prev_tokens[idx], mx.array(host, dtype=prev_tokens.dtype))
        return tok[:, None]
