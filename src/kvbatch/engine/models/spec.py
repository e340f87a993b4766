"""Describe a loaded mlx-lm model as a `ModelSpec`: geometry, dtype, KV layers, and
whether kvbatch's paged KV cache can serve every one of its layers.

The KV layers are read from the model's own `make_cache()` when it has one:
plain `KVCache` layers are what the paged cache replaces; rotating (sliding
window) and recurrent/array caches are flagged in `unsupported_reason`.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlc

from kvbatch.engine.types import ModelSpec

RECURRENT_FAMILIES = frozenset({
    "mamba", "mamba2", "rwkv7", "recurrent_gemma", "qwen3_next", "qwen3_5", "lfm2", "lfm2_moe",
    "lfm2-vl", "falcon_h1", "jamba", "nemotron_h", "granitemoehybrid", "plamo2", "kimi_linear",
    "bailing_hybrid", "bailing_moe_linear", "olmo_hybrid", "baichuan_m1",
})
_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


class _LMModel(Protocol):
    """What is read of an mlx-lm model beyond nn.Module (whose attributes mlx types as "Any | None")."""

    layers: list


def _text_config(config: dict) -> dict:
    return {**config, **config.get("text_config", {})}


def _model_dtype(params: list[tuple[str, mx.array]]) -> str:
    """The floating dtype holding the most bytes (scales of a quantized model count)."""
    totals: Counter = Counter()
    for _, v in params:
        if v.dtype in _DTYPE_NAMES:
            totals[_DTYPE_NAMES[v.dtype]] += v.nbytes
    return totals.most_common(1)[0][0] if totals else "float32"


def _layer_caches(model: nn.Module) -> list:
    make_cache = getattr(model, "make_cache", None)
    if make_cache is not None:
        return list(make_cache())
    return [mlc.KVCache() for _ in cast(_LMModel, model).layers]


def _unsupported(family: str, config: dict, caches: list) -> Optional[str]:
    if family in RECURRENT_FAMILIES:
        return f"model family {family!r} has recurrent/state-space layers; kvbatch only pages attention KV caches"
    if "sliding_attention" in (config.get("layer_types") or []):
        return f"model family {family!r} has sliding-window attention layers (layer_types); not supported yet"
    if family in ("llama", "mistral") and config.get("sliding_window"):
        return f"config sets sliding_window={config['sliding_window']}; sliding-window attention is not supported yet"
    for i, c in enumerate(caches):
        if type(c) is not mlc.KVCache:
            return f"layer {i} needs a {type(c).__name__}; kvbatch only provides a plain (paged) KV cache"
    return None


def model_spec(name: str, model: nn.Module, config: dict) -> ModelSpec:
    """Build the ModelSpec of a model loaded by mlx-lm with its config.json dict."""
    cfg = _text_config(config)
    family = str(cfg.get("model_type", config.get("model_type", "unknown")))
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))  # (no destination: a list)
    heads = int(cfg.get("num_attention_heads", 0))
    hidden = int(cfg.get("hidden_size", 0))
    head_dim = cfg.get("head_dim") or (hidden // heads if heads else 0)
    caches = _layer_caches(model)
    kv_layers = tuple(i for i, c in enumerate(caches)
                      if isinstance(c, (mlc.KVCache, mlc.RotatingKVCache, mlc.QuantizedKVCache)))
    return ModelSpec(
        name=name,
        family=family,
        num_layers=len(cast(_LMModel, model).layers),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        dtype=_model_dtype(params),
        context_length=int(cfg.get("max_position_embeddings") or 0),
        vocab_size=int(cfg.get("vocab_size", 0)),
        kv_layers=kv_layers,
        weights_bytes=sum(v.nbytes for _, v in params),
        unsupported_reason=_unsupported(family, cfg, caches),
    )
