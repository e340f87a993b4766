"""The engine's public data types: what pipeline submits and what it gets back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ModelSpec:
    """Geometry of a loaded model, enough to price its KV cache and gate KV modes."""

    name: str
    family: str  # mlx-lm model_type, e.g. "llama", "qwen3"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    context_length: int
    vocab_size: int
    kv_layers: tuple[int, ...]  # indices of layers that hold a KV cache
    weights_bytes: int = 0
    # Set when some layer needs a cache kvbatch does not provide yet
    # (sliding window, recurrent state); the engine refuses such models.
    unsupported_reason: Optional[str] = None


MAX_LOGPROBS = 20  # most alternatives a row records per token (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling, named as vLLM's SamplingParams. temperature 0 means greedy; every other
    default is "off". engine/sampling.py says in which order the controls apply."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # a row ends when it samples one (the token is not output)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0  # tokens of the prompt and output: logit / p (positive) or x p (negative)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already output
    frequency_penalty: float = 0.0  # subtracted once per time a token was output
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and stop strings not checked) before this many
    ignore_eos: bool = False  # EOS is an ordinary token (output like any other)
    logprobs: int = 0  # record each output token's log-probability and the top `logprobs` alternatives
    prompt_logprobs: bool = False  # record the log-probability of every prompt token after the first
    grammar: Optional[str] = None  # llguidance grammar the output must match (engine/grammar.py makes one)

    def problem(self) -> Optional[str]:
        """Why these parameters cannot run (None: they can)."""
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0 and 0 <= self.min_p <= 1):
            return f"bad sampling parameters: {self}"
        if not self.repetition_penalty > 0:
            return f"repetition_penalty must be > 0, got {self.repetition_penalty}"
        if not (abs(self.presence_penalty) <= 2 and abs(self.frequency_penalty) <= 2):
            return "presence_penalty and frequency_penalty must be in [-2, 2]"
        if not 0 <= self.min_tokens <= self.max_tokens:
            return f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
        return None


@dataclass
class Request:
    """One row to generate. `key` is the stable row key. `group`: requests that are samples of one
    prompt (same group, same prompt tokens) are prefilled once and forked (engine/sharing.py);
    each still has its own key, seed and result (engine/samples.py makes them)."""

    key: str
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    group: Optional[str] = None


@dataclass
class RowStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: Optional[float] = None  # from admission to the first token
    queue_s: Optional[float] = None  # from add() to admission (waiting for a slot or memory)
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken from cached or shared pages instead of computed
    decode_tps: Optional[float] = None
    wall_s: float = 0.0
    peak_kv_bytes: int = 0
    route: str = ""


@dataclass
class Logprobs:
    """What a row recorded with `logprobs` / `prompt_logprobs` (log-probabilities of the model's own
    distribution: before temperature, penalties, filters and the grammar mask, as vLLM's default)."""

    tokens: list[float] = field(default_factory=list)  # one per output token
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per output token: (id, logprob), best first
    prompt: Optional[list[float]] = None  # prompt_logprobs: one per prompt token after the first

    @property
    def total(self) -> float:
        """The output's log-probability: the sum over its tokens."""
        return float(sum(self.tokens))


@dataclass
class Result:
    key: str
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error_code: Optional[str] = None
    error_message: Optional[str] = None
    stats: RowStats = field(default_factory=RowStats)
    # which stop string ended the row, or the stop token's id as text; None for EOS, a grammar's end,
    # length and errors (vLLM's stop_reason)
    stop_reason: Optional[str] = None
    logprobs: Optional[Logprobs] = None  # set when the row asked for logprobs or prompt_logprobs

    @property
    def ok(self) -> bool:
        return self.error_code is None
