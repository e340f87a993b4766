"""Whether speculation pays at the batch size running, measured as the job runs.

A verification pass costs more than a decode step (k + 1 tokens a row through the model) and gives
back 1 + the accepted tokens of each row. Where a step is bound by reading the weights (small
batches) that pays; where the batch already keeps the device busy it may not: on an H200 at 1,024
rows n-gram speculation ran at 0.63x plain decode with 88.5% of its proposals accepted. Which side of
that line a job is on depends on the model, the backend, the rows' contexts and the acceptance, so it
is measured: per batch-size band (powers of two) the output tokens a second of steps that verified
proposals and of steps that did not, and a step speculates while the first rate is at least the
second. A band measures both first; then the mode not chosen runs one step in every PROBE_EVERY, so
the choice follows acceptance and context as they change. Outputs do not depend on the choice (a
verification pass keeps exactly the tokens decode steps would give); only the speed does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_STEPS = 3  # steps of each mode measured in a band before the two are compared
PROBE_EVERY = 32  # in a band, one step in this many runs the mode not chosen, to measure it again
DECAY = 0.8  # weight of a band's earlier steps against each new one (recent steps count most)


@dataclass
class _Rate:
    """Output tokens and seconds of one mode's steps in a band, recent steps weighted most."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds
        self.steps += 1

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf


@dataclass
class _Band:
    verified: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    since_probe: int = 0


class Payoff:
    """Says whether the next step speculates (`speculate`) from the steps measured so far (`record`)."""

    def __init__(self) -> None:
        self.bands: dict[int, _Band] = {}
        self.plain_steps = 0  # steps run without proposals because plain steps measured faster (or to measure them)

    def speculate(self, rows: int) -> bool:
        """Whether a step of `rows` decoding rows proposes tokens."""
        b = self.bands.setdefault(rows.bit_length(), _Band())
        if b.verified.steps < MIN_STEPS:
            go = True
        elif b.plain.steps < MIN_STEPS:
            go = False
        else:
            go = b.verified.per_s >= b.plain.per_s
            b.since_probe += 1
            if b.since_probe >= PROBE_EVERY:  # the other mode, once, to follow changes
                b.since_probe = 0
                go = not go
        self.plain_steps += not go
        return go

    def record(self, rows: int, verified: bool, tokens: int, seconds: float) -> None:
        """A step of `rows` decoding rows ran (`verified`: proposals were checked in it) and gave `tokens` output
        tokens in `seconds` (host and device, start to accepted tokens)."""
        b = self.bands.setdefault(rows.bit_length(), _Band())
        (b.verified if verified else b.plain).add(tokens, seconds)
