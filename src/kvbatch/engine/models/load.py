"""Load the model a `ModelConfig` names: (mlx-lm model, tokenizer, ModelSpec)."""
from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model as mlx_lm_load_model

from kvbatch.engine import lora
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.fast_tokenizer import fast_tokenizer
from kvbatch.engine.models.sources import resolve_model_dir
from kvbatch.engine.models.spec import model_spec
from kvbatch.engine.types import ModelSpec

_DEFAULT_NAME = ModelConfig.name
log = logging.getLogger(__name__)


def _display_name(cfg: ModelConfig, path: Path) -> str:
    if cfg.source == "smollm2" or cfg.name != _DEFAULT_NAME:
        return cfg.name
    return path.name if cfg.source == "tiny" or not cfg.path else cfg.path.rstrip("/").split("/")[-1]


def cpu_half_warning(model: nn.Module, spec: ModelSpec) -> str | None:
    """A warning when half-precision weights run on MLX's CPU backend, whose float16/bfloat16 matmuls
    are several times slower than float32 (the CPU default, `model.dtype=auto`). Quantized models
    (their scales are half) are not meant: they have no float32 form to suggest."""
    from kvbatch.engine.backend import on_cpu

    if not on_cpu() or spec.dtype not in ("float16", "bfloat16"):
        return None
    if any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()):
        return None
    return (f"kvbatch: warning: the model's weights are {spec.dtype} on the CPU backend, where MLX runs "
            f"half-precision matmuls several times slower than float32: set model.dtype=float32")


def load_tokenizer(path: Path, model: nn.Module, config: dict) -> Any:
    """The model's tokenizer: kvbatch's `FastTokenizer` (the tokenizers library, no transformers)
    where it gives mlx-lm's tokens, else mlx-lm's `load_tokenizer` (transformers, imported here)."""
    defaults = getattr(importlib.import_module(type(model).__module__), "TOKENIZER_DEFAULTS", None)
    tokenizer = fast_tokenizer(path, config, config.get("eos_token_id"), defaults)
    if tokenizer is not None:
        return tokenizer
    log.debug("tokenizer in %s: through mlx-lm (transformers)", path)
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    return mlx_lm_load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def load_model(cfg: ModelConfig) -> tuple[nn.Module, Any, ModelSpec]:
    """Resolve (convert/build once if needed) and load the model; raise KvbatchConfigError on bad config."""
    path = resolve_model_dir(cfg)
    try:
        model, config = mlx_lm_load_model(path)
        tokenizer = load_tokenizer(path, model, config)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise KvbatchConfigError(f"mlx-lm cannot load the model in {path}: {exc}") from exc
    if cfg.source == "local" and cfg.dtype not in ("auto", "quantized"):
        if cfg.dtype not in ("float32", "float16", "bfloat16"):
            raise KvbatchConfigError(f"model.dtype={cfg.dtype!r} is not one of auto, float32, float16, bfloat16")
        model.set_dtype(getattr(mx, cfg.dtype))
    if cfg.adapter_path and cfg.adapters:
        raise KvbatchConfigError("set model.adapter_path (one adapter for every row) or model.adapters (rows pick "
                                 "one), not both")
    if cfg.adapter_path:
        lora.load_job_adapter(model, cfg.adapter_path)
    if cfg.adapters:
        lora.install(model, dict(cfg.adapters))
    # after the adapters: their weights count in the spec's weights_bytes (the memory model's)
    return model, tokenizer, model_spec(_display_name(cfg, path), model, config)
