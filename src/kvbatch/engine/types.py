"""The engine's public data types: what pipeline submits and what it gets back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvbatch.engine.params import SamplingParams


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


@dataclass
class Request:
    """One row to generate. `key` is the stable row key. `group`: requests that are samples of one
    prompt (same group, same prompt tokens) are prefilled once and forked (engine/sharing.py);
    each still has its own key, seed and result (engine/samples.py makes them)."""

    key: str
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    group: Optional[str] = None
    adapter: Optional[str] = None  # one of the model's per-row LoRA adapters by name (engine/lora.py); None: base


@dataclass
class RowStats:
    """A finished row's counters and timings (results.parquet's stats columns)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: Optional[float] = None  # from admission to the first token
    queue_s: Optional[float] = None  # from add() to admission (waiting for a slot or memory)
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken from cached or shared pages instead of computed
    resumed_tokens: int = 0  # output tokens kept from a checkpoint: generated before this run (engine/resume.py)
    decode_tps: Optional[float] = None
    wall_s: float = 0.0
    peak_kv_bytes: int = 0
    route: str = ""
    spec_proposed: int = 0  # speculative decoding: tokens proposed for the row, and those accepted
    spec_accepted: int = 0


@dataclass
class Logprobs:
    """What a row recorded with `logprobs` / `prompt_logprobs` (log-probabilities of the model's own
    distribution: before the sampler's penalties, filters, grammar mask and scaling, as vLLM's default)."""

    tokens: list[float] = field(default_factory=list)  # one per output token
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per output token: (id, logprob), best first
    prompt: Optional[list[float]] = None  # prompt_logprobs: one per prompt token after the first

    @property
    def total(self) -> float:
        """The output's log-probability: the sum over its tokens."""
        return float(sum(self.tokens))


@dataclass
class RowCheckpoint:
    """A row's generated tokens at a step boundary, and its output logprobs so far (rows that record them)."""

    tokens: list[int]
    logprobs: Optional[list[float]] = None  # one per token
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: (id, logprob), best first


@dataclass
class Result:
    """What the engine returns for one row: its tokens and text, why it ended, and its stats."""

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
    # rows with reasoning tags (engine/reasoning.py split): the block's text (None: the row had none) and
    # the answer after it
    reasoning: Optional[str] = None
    answer: Optional[str] = None

    @property
    def ok(self) -> bool:
        """Whether the row ended without an error code."""
        return self.error_code is None
