"""Whether speculation pays at the batch size running, measured as the job runs.

A verification pass costs more than a decode step (k + 1 tokens a row through the model) and gives
back 1 + the accepted tokens of each row. Where a step is bound by reading the weights (small
batches) that pays; where the batch already keeps the device busy it may not: on an H200 at 1,024
rows n-gram speculation ran at 0.63x plain decode with 88.5% of its proposals accepted. Which side of
that line a job is on depends on the model, the backend, the rows' contexts and the acceptance, so it
is measured: per batch-size band (powers of two) the output tokens a second of steps that verified
proposals and of steps that did not (the median of each mode's last RECENT steps: one step that
compiled kernels for a new shape, seconds where the others take milliseconds, must not decide a
band), and a step speculates while the first rate is at least the second. A band measures both
first (MIN_STEPS steps each), unless it is entered next to a band that has (rows finishing, rows
joining): then it starts from that band's choice, since half or twice the rows pay alike. In a band
the mode not chosen runs once in every PROBE_EVERY steps (a probe: one step, or a run, below), so the choice
follows acceptance and context as they change (once in every LEARN_EVERY while the band has no figures of
its own and its neighbour's two rates were within CLEAR of each other). Outputs do not depend on the choice (a
verification pass keeps exactly the tokens decode steps would give); only the speed does.

With the lookahead (the GPU backends' decode loop, `pipelined`) a plain step is built while the step before it
computes, so in a run of plain steps the host's work hides behind the device's; a verification pass cannot hide
its own (the next pass needs its tokens). A lone plain step between passes has nothing to hide behind: it costs
its host work and its device work end to end, where a step in a run of plain steps costs about the larger of the
two (on MLX CUDA at hundreds of rows, as little as half), so measured alone plain decode looks slower than it runs
when chosen. When pipelined, each mode is therefore measured in runs of PIPELINED_RUN steps (in a band measured
itself, a probe once in every PROBE_EVERY x PIPELINED_RUN steps: the same share of steps as one step in
PROBE_EVERY), and the first step after a change of mode, which carries the pipeline's refill, is not counted.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

MIN_STEPS = 3  # steps of each mode measured in a band before the two are compared
PROBE_EVERY = 32  # in a band, one step in this many runs the mode not chosen, to measure it again
LEARN_EVERY = 4  # ... one in this many while the band has not measured both modes itself, unless
CLEAR = 1.25  # the neighbouring band found one mode this many times faster than the other
RECENT = 5  # a mode's rate in a band: the median of its last this many steps' tokens a second
PIPELINED_RUN = 4  # pipelined: the steps a probe (or a first measurement) of a mode runs in a row; a band measured
# itself probes with one such run in every PROBE_EVERY x PIPELINED_RUN steps


@dataclass
class _Rate:
    """One mode's steps in a band: how many, and the output tokens a second of the most recent."""

    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.recent.append(tokens / seconds if seconds > 0 else float("inf"))
        self.steps += 1

    @property
    def rate(self) -> float:
        """The median of the recent steps' tokens a second (one outlier among them moves it not at all)."""
        return statistics.median(self.recent)


@dataclass
class _Band:
    verified: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    since_probe: int = 0
    probe_left: int = 0  # steps of the running probe still to come

    @property
    def measured(self) -> bool:
        """Whether both modes have MIN_STEPS steps here."""
        return self.verified.steps >= MIN_STEPS and self.plain.steps >= MIN_STEPS


class Payoff:
    """Says whether the next step speculates (`speculate`) from the steps measured so far (`record`)."""

    def __init__(self, pipelined: bool = False) -> None:
        self.bands: dict[int, _Band] = {}
        self.plain_steps = 0  # steps run without proposals because plain steps measured faster (or to measure them)
        self.pipelined = pipelined
        self._last: Optional[bool] = None  # the mode of the last step recorded (pipelined: a change is not counted)

    @property
    def run(self) -> int:
        """The steps a probe lasts."""
        return PIPELINED_RUN if self.pipelined else 1

    def speculate(self, rows: int) -> bool:
        """Whether a step of `rows` decoding rows proposes tokens."""
        key = rows.bit_length()
        b = self.bands.setdefault(key, _Band())
        ratio = self._ratio(key)
        if ratio is None:  # nothing measured yet: both modes, verifying first
            go = b.verified.steps < MIN_STEPS
        else:
            go = ratio >= 1.0
            if b.probe_left:  # a probe's run goes on
                b.probe_left -= 1
                go = not go
            else:
                b.since_probe += 1
                if b.measured:  # a run's probe comes run times as rarely: the same share of steps probing
                    every = PROBE_EVERY * self.run
                else:  # a neighbour's verdict: checked soon, sooner where its two rates were close
                    every = PROBE_EVERY if not 1 / CLEAR < ratio < CLEAR else LEARN_EVERY
                if b.since_probe >= every:  # the other mode, for one run
                    b.since_probe, b.probe_left = 0, self.run - 1
                    go = not go
        self.plain_steps += not go
        return go

    def _ratio(self, key: int) -> Optional[float]:
        """Verifying steps' tokens a second over plain steps' in band `key`: from its own steps once both modes
        have MIN_STEPS there, else from a neighbouring band's (half or twice the rows) where they have (None:
        neither has)."""
        near = [k for k in (key, key - 1, key + 1) if k in self.bands and self.bands[k].measured]
        if not near:
            return None
        v, p = self.bands[near[0]].verified.rate, self.bands[near[0]].plain.rate
        return v / p if p > 0 else (float("inf") if v > 0 else 1.0)

    def record(self, rows: int, verified: bool, tokens: int, seconds: float) -> None:
        """A step of `rows` decoding rows ran (`verified`: proposals were checked in it) and gave `tokens` output
        tokens in `seconds` (host and device, start to accepted tokens). Pipelined, the first step after a
        change of mode is not counted: it paid for refilling the pipeline, which a run of that mode pays once."""
        changed, self._last = self._last is not None and verified != self._last, verified
        if changed and self.pipelined:
            return
        b = self.bands.setdefault(rows.bit_length(), _Band())
        (b.verified if verified else b.plain).add(tokens, seconds)
