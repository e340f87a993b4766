"""Shared pytest fixtures.

`import engine` comes first: it loads OpenBLAS before anything imports mlx
(loading it later has no effect, see engine/blas.py).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import engine  # noqa: F401  (must precede any mlx import)
import pytest

from engine.models.config import ModelConfig
from engine.models.load import load_model


@pytest.fixture(scope="session")
def model_cache_dir():
    """A session-wide model cache dir (converted/built models), deleted at the end."""
    with tempfile.TemporaryDirectory(prefix="kvbatch-models-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def smollm2_config(model_cache_dir) -> ModelConfig:
    """ModelConfig of the default SmolLM2 model (float32 on CPU), cached in `model_cache_dir`."""
    return ModelConfig(source="smollm2", cache_dir=str(model_cache_dir))


@pytest.fixture(scope="session")
def smollm2(smollm2_config):
    """(model, tokenizer, spec) of SmolLM2-135M-Instruct, converted once per session."""
    return load_model(smollm2_config)


@pytest.fixture(scope="session")
def tiny_model(model_cache_dir):
    """Factory: tiny_model(**ModelConfig overrides) -> (model, tokenizer, spec).

    Seeded random llama/qwen3 (default: llama, 2 layers, 4 heads, 2 KV heads,
    head_dim 64, vocab 300, float32). Byte tokenizer: ids 0-255 are bytes,
    256 <|im_start|>, 257 <|im_end|> (eos), 258 <|endoftext|>. Same
    overrides -> the same loaded objects (cached for the session).
    """
    loaded: dict = {}

    def make(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in loaded:
            fields = {"source": "tiny", "name": "tiny", "cache_dir": str(model_cache_dir), **overrides}
            cfg = ModelConfig(**fields)
            loaded[key] = load_model(cfg)
        return loaded[key]

    return make
