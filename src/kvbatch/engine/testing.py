"""What tests and benchmarks build (they import it from here; no pytest in it): an EngineConfig from the few
flat settings they vary, and a random LoRA adapter folder."""
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



def write_random_adapter(folder, model, seed: int, rank: int = 4, scale: float = 2.0,
                         keys: tuple[str, ...] = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"),
                         std: float = 0.05):
    """An mlx-lm LoRA adapter folder (adapter_config.json, adapters.safetensors, as mlx_lm.tuner writes
    them) of seeded N(0, std) weights for every layer's `keys` of `model` (tests and benchmarks); its path."""
    import json
    from pathlib import Path

    import mlx.core as mx

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights, key = {}, mx.random.key(seed)
    for i, layer in enumerate(model.layers):
        modules = dict(layer.named_modules())
        for k in keys:
            out_dims, in_dims = modules[k].weight.shape
            key, ka, kb = mx.random.split(key, 3)
            weights[f"model.layers.{i}.{k}.lora_a"] = std * mx.random.normal((in_dims, rank), key=ka)
            weights[f"model.layers.{i}.{k}.lora_b"] = std * mx.random.normal((rank, out_dims), key=kb)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers),
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
