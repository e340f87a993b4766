"""A process-level cache of loaded models, for sweeps: one load per distinct model config.

Hydra's basic launcher runs every job of a multirun in one process. `kvbatch -m
kv=none,q8,q4` would load the same model three times; with the cache on (sweep jobs
turn it on) the second and third job reuse the first one's model, tokenizer and spec.
The key is the resolved model config (every field, so `model.head_dim=32` is a
different model). Engines and their KV pools are never cached: each job builds its
own, and `release()` hands their memory back between jobs.

The cache keeps the most recently used models while their weights together stay
under `max_bytes` (a quarter of the machine's memory by default); the model in use
is always kept. With the cache off (a single run), `load_model` loads directly.
"""
from __future__ import annotations

import gc
import json
from collections import OrderedDict
from dataclasses import asdict
from typing import Any, Optional

from kvbatch.engine.models.config import ModelConfig

_cache: "OrderedDict[str, tuple[Any, Any, Any]]" = OrderedDict()
_enabled = False
_max_bytes: Optional[int] = None
loads = 0  # models actually loaded by this process through load_model (tests read it)


def enable(on: bool = True, max_bytes: Optional[int] = None) -> None:
    """Turn caching on (sweep jobs) or off (and empty the cache)."""
    global _enabled, _max_bytes
    _enabled, _max_bytes = on, max_bytes
    if not on:
        clear()


def enabled() -> bool:
    """Whether the model cache is on (sweep jobs turn it on)."""
    return _enabled


def key_of(cfg: ModelConfig) -> str:
    """The cache key of a model config: every field, as sorted JSON."""
    d = asdict(cfg) if not isinstance(cfg, dict) else dict(cfg)
    return json.dumps(d, sort_keys=True, default=str)


def _limit() -> int:
    if _max_bytes is not None:
        return _max_bytes
    import psutil

    return psutil.virtual_memory().total // 4


def _weights(entry: tuple[Any, Any, Any]) -> int:
    return int(getattr(entry[2], "weights_bytes", 0) or 0)


def load_model(cfg: ModelConfig):
    """(model, tokenizer, spec) for this model config: from the cache when it is on and holds it."""
    global loads
    from kvbatch.engine import load_model as engine_load

    if not _enabled:
        loads += 1
        return engine_load(cfg)
    key = key_of(cfg)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    # Make room first, so two big models never sit in memory together beyond the limit.
    while _cache and sum(_weights(e) for e in _cache.values()) >= _limit():
        _cache.popitem(last=False)
        release()
    entry = engine_load(cfg)
    loads += 1
    _reset_peak()  # a job's peak memory is its weights + KV + workspace, not the load's transients
    _cache[key] = entry
    while len(_cache) > 1 and sum(_weights(e) for e in _cache.values()) > _limit():
        _cache.popitem(last=False)
    return entry


def _reset_peak() -> None:
    try:
        import mlx.core as mx

        mx.reset_peak_memory()
    except Exception:  # noqa: BLE001
        pass


def cached_keys() -> list[str]:
    """The keys of the models cached now, least recently used first."""
    return list(_cache)


def clear() -> None:
    """Drop every cached model and hand their memory back."""
    _cache.clear()
    release()


def release() -> None:
    """Hand back memory nothing references any more (dropped engines, KV pools, evicted models)."""
    gc.collect()
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # noqa: BLE001 - best effort; never fails a job
        pass
