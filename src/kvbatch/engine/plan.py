"""What one engine step does, decided before it runs: the Scheduler's plan and the Runner's
time accounting.

A step is `schedule -> run -> output` (as vLLM v1's SchedulerOutput and nano-vllm's
schedule/run/postprocess). The Scheduler admits and refuses rows, reserves the pages of every
prefill chunk and decode token (preempting under `optimistic` admission) and returns a
`StepPlan`; the Runner runs its passes; the OutputProcessor turns their tokens into results.
The decode rows are decided after the step's prefill pass, since a prompt that pass completes
(and the samples forked from it) decodes in the same step: the plan is completed then.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvbatch.engine.row import Row


class Chunk(NamedTuple):
    """A row's next prefill chunk: its next `tokens` prompt tokens, their pages reserved."""

    row: Row
    tokens: int


class Refusal(NamedTuple):
    """A row the step ends with an error before it runs (its input, or no room for it alone)."""

    row: Row
    code: str
    message: str


@dataclass(frozen=True)
class StepPlan:
    """One step's decisions. admitted: rows that joined the running batch (to be prefilled);
    refused: rows that never run (their input, or their worst case over the whole budget);
    no_room: running rows that cannot grow even alone (taken out of the batch, to end in error);
    preempted: rows whose pages were freed to make room (back at the head of the queue);
    prefill: the prefill pass's chunks, in admission order; decode: the decode step's rows."""

    admitted: tuple[Row, ...] = ()
    refused: tuple[Refusal, ...] = ()
    no_room: tuple[Refusal, ...] = ()
    preempted: tuple[Row, ...] = ()
    prefill: tuple[Chunk, ...] = ()
    decode: tuple[Row, ...] = ()


@dataclass
class StepTimes:
    """Where the engine's time went, since it was built: prefill and decode seconds and tokens."""

    prefill_time: float = 0.0
    prefill_tokens: int = 0
    prefill_passes: int = 0
    prefill_rows_max: int = 0  # most rows in one prefill pass
    decode_time: float = 0.0
    decode_tokens: int = 0
    cache_clears: int = 0  # MLX's buffer cache given back whole to keep within the budget (Runner.trim_cache)
    t_accepted: float = 0.0  # lookahead: when the host last read a step (decode time restarts there)
    # lookahead: the seconds of the last decode step's dispatch while no read has counted them (a read counts
    # from the read or prefill pass before it; a step dispatched before a prefill pass is read after it)
    dispatch_unread: float = 0.0
