"""Decode lookahead: the next decode step is dispatched before the host reads the previous
step's tokens (as mlx-lm's BatchGenerator does), so a GPU never waits while the host builds
a step's graph. A mixin of `engine.engine.Engine`, kept apart because it is a second way to
run the same step: tokens, logits and finish reasons are those of `Engine._decode_step`
(tests/engine/test_lookahead.py)."""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from kvbatch.engine import attention, errors
from kvbatch.engine.errors import RowError


@dataclass
class InflightStep:
    """A decode step dispatched to the device whose tokens the host has not read yet."""

    rows: list  # engine._Row
    logits: mx.array
    tokens: mx.array
    finite: mx.array
    t0: float


def lookahead_default() -> bool:
    """KVBATCH_LOOKAHEAD=1/0 forces it; else on for GPU backends (MLX CUDA, Metal), where the
    device would otherwise wait while the host builds each step's graph; off on the CPU
    backend (the CPU does both)."""
    env = os.environ.get("KVBATCH_LOOKAHEAD", "").strip()
    return env == "1" if env else not attention.on_cpu()


class LookaheadDecode:
    """Engine methods for decoding with one step in flight (uses the Engine's state: running,
    waiting, cache, _inflight, _t_accepted, and its _forward_sample / _accept / _end_running)."""

    def _decode_step_lookahead(self) -> None:
        """One decode step with the previous one still in flight: the next step's graph is built
        from the previous step's tokens as lazy arrays and dispatched (mx.async_eval) before the
        host reads those tokens, so the device never waits for graph building (mlx-lm's
        BatchGenerator does the same). Rows whose previous step is known to be their last
        (max_tokens, context, forced tokens) are left out; a row that stops on its token (EOS,
        stop string, non-finite logits) is found one step late: that extra step's output is
        dropped (its K/V went to the row's own pages, released after it in stream order).
        Tokens, logits and finish reasons are those of `_decode_step`."""
        prev, self._inflight = self._inflight, None
        ahead = frozenset(id(r) for r in prev.rows) if prev else frozenset()
        if prev is not None and self.waiting and any(self._last_step(r) for r in prev.rows):
            # a slot frees with this step: read it now, so the waiting row joins the next step
            self._accept_step(prev)
            return
        rows, refused = [], []
        limit, want = self._kv_limit(), self._pool_want()
        for r in list(self.running):
            if id(r) in ahead and self._last_step(r):
                continue
            try:
                self.cache.reserve(r.kv, 1, limit, want)
                rows.append(r)
            except RowError as e:
                refused.append((r, e))  # ended after the in-flight token is accepted
        failed = None
        if rows:
            t0 = time.perf_counter()
            try:
                inputs = self._next_inputs(rows, prev, ahead)
                self.cache.begin([r.kv for r in rows], 1, self._poison(rows, ahead))
                try:
                    logits, tokens, finite = self._forward_sample(rows, inputs)
                    mx.async_eval(tokens, finite)
                finally:
                    self.cache.end()
                self._inflight = InflightStep(rows, logits, tokens, finite, t0)
            except Exception as e:
                failed = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        if prev is not None:
            self._accept_step(prev)  # waits for that step only; the next one keeps the device busy
        for r, e in refused:
            if not r.ended:
                self._end_running(r, "error", e.code, e.message)
        if failed:
            self._inflight = None
            for r in rows:
                if not r.ended:
                    self._end_running(r, "error", errors.INTERNAL_ERROR, failed)

    def _accept_step(self, step: InflightStep) -> None:
        step.tokens.tolist()
        now = time.perf_counter()
        self.decode_time += now - max(step.t0, self._t_accepted)
        self._t_accepted = now
        self.decode_tokens += sum(not r.ended for r in step.rows)
        self._trim_cache()
        self._accept(step.rows, step.logits, step.tokens, step.finite)

    def _last_step(self, r) -> bool:
        """Whether the row's in-flight token ends it whatever that token is (see _accept)."""
        n, p, forced = len(r.out) + 1, r.req.sampling, r.req.forced_tokens
        return (n >= p.max_tokens or len(r.req.prompt_tokens) + n >= self.spec.context_length
                or (forced is not None and n >= len(forced)))

    def _next_inputs(self, rows: list, prev: Optional[InflightStep], ahead: frozenset) -> mx.array:
        """(B, 1) input tokens: a forced token or a token the host holds, else the row's token
        from the in-flight step (lazy)."""
        host, pick = [], []
        at = {id(r): i for i, r in enumerate(prev.rows)} if prev else {}
        for r in rows:
            forced = r.req.forced_tokens
            if id(r) not in ahead:
                host.append(r.out[-1])
                pick.append(-1)
            elif forced is not None and len(r.out) < len(forced):
                host.append(forced[len(r.out)])
                pick.append(-1)
            else:
                host.append(0)
                pick.append(at[id(r)])
        if all(i < 0 for i in pick):
            return mx.array(host)[:, None]
        if all(i >= 0 for i in pick) and pick == list(range(len(prev.rows))):
            return prev.tokens[:, None]
        idx = mx.array([max(i, 0) for i in pick])
        tok = mx.where(mx.array([i >= 0 for i in pick]), prev.tokens[idx], mx.array(host, dtype=prev.tokens.dtype))
        return tok[:, None]
