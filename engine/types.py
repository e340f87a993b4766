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


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Request:
    """One row to generate. `key` is the stable row key."""

    key: str
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RowStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: Optional[float] = None  # from admission to the first token
    queue_s: Optional[float] = None  # from add() to admission (waiting for a slot or memory)
    preemptions: int = 0
    decode_tps: Optional[float] = None
    wall_s: float = 0.0
    peak_kv_bytes: int = 0
    route: str = ""


@dataclass
class Result:
    key: str
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error_code: Optional[str] = None
    error_message: Optional[str] = None
    stats: RowStats = field(default_factory=RowStats)

    @property
    def ok(self) -> bool:
        return self.error_code is None
