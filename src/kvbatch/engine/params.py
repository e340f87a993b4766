"""The per-row parameters, each defined once: SamplingParams' fields and the table `PARAMS` made from them.

A field a row may set carries a `RowParam` in its metadata: how a row's value is read (its kind), its
range check, the config section that holds the job's value, its results column. The engine's range
check (`SamplingParams.problem`) and the pipeline's config check, input reader, results schema, API
keywords and OpenAI Batch mapping all loop over `PARAMS` (pipeline/row_params.py), so a new per-row
parameter is a field here plus the code that applies it.

Why one range, refused where a value is read: a value accepted must fit the results schema (int32
and int64 columns) and the sampler, which scales log-probabilities by 1/temperature: a temperature
near zero overflows float32 and samples garbage without an error. The engine refuses what the config
and the input reader refuse, with the same bounds. Every float control has the range where the
sampler's float32 arithmetic stays finite (temperature, repetition_penalty, top_p below; min_p and the
presence/frequency penalties are bounded by their meaning).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

from kvbatch.engine.reasoning import ReasoningTags

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # the results' seed column is int64 (MLX keys take up to 2**64 - 1)
MIN_TEMPERATURE = 1e-3  # below this (and above 0) 1/T overflows on fp16 logits; use 0 for greedy
MAX_TEMPERATURE = 1e3
# repetition_penalty divides (or multiplies) float32 logits: outside this range a logit overflows to inf, or
# a tiny factor rounds to 0 in float32 and divides by zero (garbage tokens, no error), as 1/temperature would
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-3, 1e3
# top_p scales the float32 probability mass: a smaller value rounds to 0 there and the sampler drops every token
MIN_TOP_P = 1e-30
MAX_SAMPLES = 4096  # n: samples of one row (queue positions per input row, pipeline/samples.py)
MAX_LOGPROBS = 20  # most alternatives a row records per token (vLLM's default max_logprobs)

Check = Callable[[Any], Optional[str]]


def max_tokens_error(v: int) -> str | None:
    """Why a max_tokens value is invalid, or None."""
    if v < 1:
        return "must be >= 1"
    if v > INT32_MAX:
        return f"must be <= {INT32_MAX} (2**31 - 1)"
    return None


def seed_error(v: int) -> str | None:
    """Why a seed is invalid, or None."""
    if v < 0:
        return "must be >= 0"
    if v > SEED_MAX:
        return f"must be <= {SEED_MAX} (2**63 - 1)"
    return None


def n_error(v: int) -> str | None:
    """Why a sample count n is invalid, or None."""
    if v < 1:
        return "must be >= 1"
    if v > MAX_SAMPLES:
        return f"must be between 1 and {MAX_SAMPLES}"
    return None


def top_k_error(v: int) -> str | None:
    """Why a top_k value is invalid, or None."""
    if v < 0:
        return "must be >= 0 (0 = off)"
    if v > INT32_MAX:
        return f"must be <= {INT32_MAX} (2**31 - 1)"
    return None


def top_p_error(v: float) -> str | None:
    """Why a top_p value is invalid, or None."""
    if not math.isfinite(v) or not 0 < v <= 1:
        return "must be in (0, 1]"
    if v < MIN_TOP_P:
        return f"must be in [{MIN_TOP_P:g}, 1] (a smaller one is 0 in float32)"
    return None


def stop_error(v: Any) -> str | None:
    """Why a list of stop strings is invalid, or None."""
    if not all(isinstance(x, str) and x for x in v):
        return "must be non-empty strings"
    return None


def temperature_error(v: float) -> str | None:
    """Why a temperature is invalid, or None."""
    if not math.isfinite(v) or v < 0:
        return "must be a finite number >= 0"
    if 0 < v < MIN_TEMPERATURE or v > MAX_TEMPERATURE:
        return f"must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}"
    return None


def min_p_error(v: float) -> str | None:
    """Why a min_p value is invalid, or None."""
    if not math.isfinite(v) or not 0 <= v <= 1:
        return "must be in [0, 1] (0 = off)"
    return None


def repetition_penalty_error(v: float) -> str | None:
    """Why a repetition_penalty is invalid, or None."""
    if not math.isfinite(v) or v <= 0:
        return "must be a finite number > 0 (1 = off)"
    if not MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY:
        return f"must be between {MIN_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g} (1 = off)"
    return None


def penalty_error(v: float) -> str | None:
    """Why a presence or frequency penalty is invalid, or None."""
    if not math.isfinite(v) or not -2 <= v <= 2:
        return "must be in [-2, 2] (0 = off)"
    return None


def min_tokens_error(v: int) -> str | None:
    """Why a min_tokens value is invalid, or None."""
    if v < 0:
        return "must be >= 0"
    if v > INT32_MAX:
        return f"must be <= {INT32_MAX} (2**31 - 1)"
    return None


def logprobs_error(v: int) -> str | None:
    """Why a logprobs count is invalid, or None."""
    if not 0 <= v <= MAX_LOGPROBS:
        return f"must be in [0, {MAX_LOGPROBS}] (0 = off)"
    return None


def stop_token_ids_error(v: Any) -> str | None:
    """Why a list of stop token ids is invalid, or None (the vocabulary is checked elsewhere)."""
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT32_MAX for x in v):
        return "must be token ids (integers >= 0)"
    return None


@dataclass(frozen=True)
class RowParam:
    """How the pipeline treats one per-row parameter (an entry of PARAMS)."""

    kind: str  # how a row's value is read: int | float | bool | ids | strings | format | name
    section: str  # the config section holding the job's value: "job" | "sampling"
    check: Optional[Check] = None  # why a value is out of range (None: it is in range)
    column: Optional[str] = None  # its results column's type: int32 | int64 | float64 | bool | ids | string
    openai: bool = False  # an OpenAI Batch request body key of the same name and meaning
    carried: bool = False  # no column of its own: the input's column comes back in results unchanged
    name: str = ""  # filled from the field
    default: Any = None  # filled from the field: the value when neither the row nor the job sets one
    engine: bool = True  # a SamplingParams field (else the pipeline turns it into what the engine takes)


def _row(default: Any, kind: str, section: str, check: Optional[Check] = None, column: Optional[str] = None,
         openai: bool = False, carried: bool = False) -> Any:
    """A SamplingParams field that a row may set (the field's default is the parameter's)."""
    return field(default=default, metadata={"row": RowParam(kind, section, check, column, openai, carried)})


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling, named as vLLM's SamplingParams. temperature 0 means greedy; every other
    default is "off". engine/sampling.py says in which order the controls apply. The field order is
    the order of the results columns."""

    max_tokens: int = _row(256, "int", "job", max_tokens_error, "int32", openai=True)
    temperature: float = _row(0.0, "float", "sampling", temperature_error, "float64", openai=True)
    top_p: float = _row(1.0, "float", "sampling", top_p_error, "float64", openai=True)
    top_k: int = _row(0, "int", "sampling", top_k_error, "int32")
    seed: int = _row(0, "int", "sampling", seed_error, "int64", openai=True)
    # no results column: the input's stop column comes back as it was
    stop: tuple[str, ...] = _row((), "strings", "job", stop_error, openai=True, carried=True)
    # drop tokens below min_p x the top token's probability
    min_p: float = _row(0.0, "float", "sampling", min_p_error, "float64")
    # tokens of the prompt and output: logit / p (positive) or x p (negative)
    repetition_penalty: float = _row(1.0, "float", "sampling", repetition_penalty_error, "float64")
    # subtracted once from the logit of every token already output
    presence_penalty: float = _row(0.0, "float", "sampling", penalty_error, "float64", openai=True)
    # subtracted once per time a token was output
    frequency_penalty: float = _row(0.0, "float", "sampling", penalty_error, "float64", openai=True)
    # EOS and stop_token_ids are masked (and stop strings not checked) before this many
    min_tokens: int = _row(0, "int", "job", min_tokens_error, "int32")
    # a row ends when it samples one (the token is not output)
    stop_token_ids: tuple[int, ...] = _row((), "ids", "job", stop_token_ids_error, "ids")
    ignore_eos: bool = _row(False, "bool", "job", column="bool")  # EOS is an ordinary token (output like any other)
    # record each output token's log-probability and the top `logprobs` alternatives
    logprobs: int = _row(0, "int", "sampling", logprobs_error, "int32")
    # record the log-probability of every prompt token after the first (its results column holds them)
    prompt_logprobs: bool = _row(False, "bool", "sampling")
    grammar: Optional[str] = None  # llguidance grammar the output must match (made from a row's response_format)
    # the model's reasoning tags (engine/reasoning.py): the grammar applies after the block; None: no reasoning
    reasoning: Optional[ReasoningTags] = None
    # with reasoning: the block's closing tag is forced after this many tokens in it (None: no limit)
    max_reasoning_tokens: Optional[int] = None

    def problem(self, vocab_size: Optional[int] = None) -> Optional[str]:
        """Why these parameters cannot run (None: they can): the ranges of PARAMS, the one range check;
        with vocab_size, also token ids outside the model's vocabulary."""
        for p in PARAMS:
            if p.engine and p.check is not None:
                v = getattr(self, p.name)
                why = p.check(v)
                if why:
                    return f"{p.name} {why}, got {v!r}"
            if vocab_size is not None and p.engine and p.kind == "ids" \
                    and ids_outside(getattr(self, p.name), vocab_size):
                return f"{p.name} outside the vocabulary (0 to {vocab_size - 1})"
        if self.max_reasoning_tokens is not None and not 0 <= self.max_reasoning_tokens <= INT32_MAX:
            return f"max_reasoning_tokens must be >= 0, got {self.max_reasoning_tokens}"
        if self.min_tokens > self.max_tokens:
            return f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
        return None


def ids_outside(ids, vocab_size: int) -> list:
    """The token ids of `ids` that are not ids of a vocabulary of `vocab_size` tokens."""
    return [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]


def _params() -> tuple[RowParam, ...]:
    engine = tuple(replace(f.metadata["row"], name=f.name, default=f.default)
                   for f in fields(SamplingParams) if "row" in f.metadata)
    pipeline = (
        # samples of the row: queue rows of their own (engine/samples.py), results' sample_index
        RowParam("int", "sampling", n_error, openai=True, name="n", default=1, engine=False),
        # the output's required shape: the pipeline makes SamplingParams.grammar from it
        RowParam("format", "job", column="string", openai=True, name="response_format", default=None, engine=False),
        # which of the model's per-row LoRA adapters it runs with (Request.adapter; null: none)
        RowParam("name", "job", column="string", name="adapter", default=None, engine=False),
    )
    return engine + pipeline


# Every per-row parameter, in results column order.
PARAMS: tuple[RowParam, ...] = _params()
