"""Several engines decoding side by side in one process, in alternating blocks of steps.

Runs of one mode after another are moved by the machine's drift: on the shared H200 one
mode's whole runs differed by up to 1.5x minutes apart (RESULTS.md, issue 9), more than the
few percent a KV mode can gain at long context. Here every engine prefills its rows, then the
engines take turns: a block of K decode steps each, the order reversed every round, each block
timed from its first step to the device finishing its last (mx.synchronize, so a step left in
flight by the engine's lookahead is not charged to the next engine). Blocks of one round are
seconds apart at most, so a round's ratio between two modes shares the machine's conditions;
the median over rounds of those ratios is the number to read.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import mlx.core as mx


class Stepper:
    """One engine's run, advanced a given number of decode steps at a time."""

    def __init__(self, eng, requests: list):
        self.eng, self.steps, self.results, self.done = eng, 0, [], False
        for r in requests:
            eng.add(r)

    def advance(self, n: int) -> int:
        """Run until n more decode steps have run (or the run ends); returns how many ran."""
        start = self.steps
        while not self.done and self.steps < start + n:
            if not self.eng.has_unfinished():
                self.done = True
                break
            decoding = bool(self.eng.scheduler.running or self.eng.scheduler.waiting)
            self.results += self.eng.step()
            self.steps += decoding
        return self.steps - start


def interleave(make: dict[str, Callable[[], Stepper]], block: int, warm: int = 1) -> dict[str, dict]:
    """make: mode -> a Stepper factory (engine built, requests submitted). Each is created and
    advanced `warm` steps (its rows' prefill and first decode steps, untimed: enough to compile
    every kernel the run will use), in the given order; then rounds of `block` steps each, order reversed every
    other round, until every run ends.
    Returns per mode: step_s (each round's seconds a step), rows (the batch), results, and the
    Stepper; full blocks only (a block cut short by the run's end is dropped)."""
    steppers = {}
    for mode, f in make.items():
        steppers[mode] = s = f()
        s.advance(max(warm, 1))
        mx.synchronize()
    step_s: dict[str, list] = {m: [] for m in steppers}
    modes, rnd = list(steppers), 0
    while any(not s.done for s in steppers.values()):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            s = steppers[mode]
            rows = len(s.eng.scheduler.running)
            t = time.perf_counter()
            n = s.advance(block)
            mx.synchronize()
            dt = time.perf_counter() - t
            step_s[mode].append(dt / n if n == block and rows else None)
        rnd += 1
    return {m: {"step_s": step_s[m], "stepper": steppers[m]} for m in steppers}


def paired_ratios(a: list, b: list) -> list[float]:
    """Round-by-round speed of a over b (b's step time / a's), rounds where both ran a full block."""
    return [y / x for x, y in zip(a, b) if x and y]


def median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x]
    return statistics.median(xs) if xs else None
