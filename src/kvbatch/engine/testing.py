"""An EngineConfig from the few flat settings tests and benchmarks vary (tests and benchmarks/ import it from
here; no pytest in it)."""
from __future__ import annotations

from kvbatch.engine.config import EngineConfig, EngineOptions, EngineSettings, KVConfig, MemoryConfig, SpeculativeConfig


def engine_config(kv_mode: str = "none", page_size: int = 64, group_size: int = 64, max_batch: int = 8,
                  prefill_chunk: int = 512, memory_budget=None, memory_fraction: float = 0.8,
                  memory_headroom: str = "1GiB", allow_unvalidated: bool = False,
                  max_prompt_tokens=None, options=None, prefill_tokens="auto", admission: str = "reserve",
                  prefix_cache: bool = True, kv=None, speculative=None):
    """An EngineConfig from the few settings tests vary (memory_budget: bytes, None = auto; kv: more
    KVConfig fields, e.g. {"rotate_keys": True}; speculative: SpeculativeConfig fields, e.g.
    {"method": "ngram"})."""
    return EngineConfig(
        kv=KVConfig(mode=kv_mode, page_size=page_size, group_size=group_size, allow_unvalidated=allow_unvalidated,
                    **(kv or {})),
        memory=MemoryConfig(budget="auto" if memory_budget is None else str(int(memory_budget)),
                            fraction=memory_fraction, headroom=memory_headroom),
        engine=EngineSettings(max_batch=max_batch, prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens,
                              admission=admission, prefix_cache=prefix_cache, options=options or EngineOptions()),
        speculative=SpeculativeConfig(**(speculative or {})),
        max_prompt_tokens=max_prompt_tokens)

