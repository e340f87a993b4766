"""Test and debug hooks, given to an Engine at construction (production passes none).

One object carries every hook, so nothing monkeypatches the engine and no production type
grows test-only fields: fault injection (NaN in one row's attention at one step, a pass that fails when
evaluated, a device that stops evaluating), teacher forcing (feed given tokens instead of sampling), logit
capture, the points where a crash injector may act (pipeline/debug.py subclasses this), and each step's plan
(for tests and profilers).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import mlx.core as mx

if TYPE_CHECKING:
    from kvbatch.engine.plan import StepPlan, StepTimes


@dataclass
class EngineHooks:
    """Test and debug hooks for one Engine: NaN injection, teacher forcing, logit capture and per-step callbacks
    (production passes none)."""

    # (row key, output step): that row's attention output becomes NaN at that step
    nonfinite: Optional[tuple[str, int]] = None
    # row key -> tokens fed instead of sampled (teacher forcing); the row ends after the last one
    forced_tokens: dict[str, list[int]] = field(default_factory=dict)
    # row keys whose every step's float32 logits (vocab,) are kept in `logits`
    capture_logits: set[str] = field(default_factory=set)
    logits: dict[str, list[mx.array]] = field(default_factory=dict)
    # benchmarks only (the verification pass's cost at a chosen acceptance): each verification keeps this
    # share of each row's proposed tokens (rounded down) whatever the model samples, and rows always propose
    # k tokens (no back-off); the kept tokens are the proposals, so outputs are not the model's
    force_acceptance: Optional[float] = None
    # N: every forward pass after the first N fails as a device fault would (tests: a device that stops
    # evaluating, on the CPU); `device_faulted` then says so, as the device probe would on the real thing
    device_fault_after: Optional[int] = None
    forward_passes: int = 0
    # N: the N-th forward pass's graph holds an op that fails when evaluated (tests: a pass that fails as an
    # allocation failure or a kernel error would, its cache writes holding the failed graph)
    eval_fault_at: Optional[int] = None
    # the clock a decode step's cost is measured with (speculative.adaptive); tests move a clock of their own
    clock: Callable[[], float] = time.perf_counter

    def force(self, key: str, tokens: list[int], capture: bool = True) -> None:
        """Teacher-force row `key` with `tokens` (and keep its logits, unless capture=False)."""
        self.forced_tokens[key] = list(tokens)
        if capture:
            self.capture_logits.add(key)

    @property
    def device_faulted(self) -> bool:
        """Whether the injected device fault (device_fault_after) has begun."""
        return self.device_fault_after is not None and self.forward_passes > self.device_fault_after

    def on_forward(self) -> Optional[mx.array]:
        """A forward pass is about to be built. Past device_fault_after it fails as a faulted device would; at
        eval_fault_at it returns a boolean scalar (False) for the pass's graph whose evaluation fails (MLX's
        gather_mm takes float32 only on the CPU, which the tests run on); else None."""
        self.forward_passes += 1
        if self.device_faulted:
            raise RuntimeError(f"injected device fault after {self.device_fault_after} forward passes")
        if self.eval_fault_at != self.forward_passes:
            return None
        a, b = mx.ones((1, 1, 2), dtype=mx.bfloat16), mx.ones((1, 2, 2), dtype=mx.bfloat16)
        return mx.gather_mm(a, b, rhs_indices=mx.array([0])).sum() < 0

    def on_row_start(self, key: str) -> None:
        """A row's prefill is about to start."""

    def on_prefill_chunk(self, key: str, done: int, total: int) -> None:
        """A prefill chunk of row `key` is computed: `done` of `total` prompt tokens."""

    def on_decode_step(self) -> None:
        """A decode step's tokens were accepted."""

    def on_step(self, plan: StepPlan, times: StepTimes) -> None:
        """A step ran: its plan (admissions, refusals, preemptions, prefill chunks, decode rows)
        and the engine's times so far (cumulative: a profiler takes differences). Read only."""
