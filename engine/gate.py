"""Which KV modes are validated for which model family and head size (fail closed).

Every entry here is exercised by tests/engine/test_kv_quant.py (teacher-forced logits
against a dequantize-and-attend reference, batched, at page sizes 16 and 64).
"""
from __future__ import annotations

from typing import Optional

from kvbatch.engine.backend import backend
from kvbatch.engine.config import GROUP_SIZES, KV_BITS, KV_MODES, EngineOptions
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.routes.select import fused_kernels
from kvbatch.engine.types import ModelSpec

# Families whose mlx-lm module routes attention through base.scaled_dot_product_attention
# and reads cache.offset for RoPE: the paged cache runs them unchanged.
PAGED_FAMILIES = frozenset({"llama", "qwen3", "qwen2", "mistral"})

VALIDATED: dict[tuple[str, int], frozenset[str]] = {
    ("llama", 64): frozenset({"none", "q8", "q4"}),
    ("llama", 128): frozenset({"none", "q8", "q4"}),
    ("llama", 256): frozenset({"none", "q8", "q4"}),
    ("qwen3", 128): frozenset({"none", "q8", "q4"}),
}
# Backends where the portable quantized route (mx.quantized_matmul) has been validated. On MLX
# CUDA (H200, mlx 0.32.4) it is not (RESULTS.md, issue 9); there q8/q4 are validated only where
# the fused kernel of routes/cuda_kernels.py runs decode (see `_cuda_quant_ok`).
QUANT_VALIDATED_BACKENDS = frozenset({"cpu", "metal"})


def _cuda_quant_ok(spec: ModelSpec, mode: str, group_size: int, options: EngineOptions) -> bool:
    """On MLX CUDA, q8/q4 decode is validated through the fused kernel (benchmarks/backend_check.py)."""
    rep = max(spec.num_heads // max(spec.num_kv_heads, 1), 1)
    return backend().name == "cuda" and fused_kernels(spec.head_dim, rep, KV_BITS[mode], group_size, options)


def check_kv_mode(spec: ModelSpec, mode: str, group_size: int, allow_unvalidated: bool = False,
                  options: Optional[EngineOptions] = None) -> None:
    """Raise KvbatchConfigError (one line) unless this model may run this KV mode (with these
    engine options: the portable route has no fused CUDA kernel)."""
    options = options or EngineOptions()
    name = backend().name
    if spec.unsupported_reason:
        raise KvbatchConfigError(f"model type '{spec.family}' is not supported by the paged cache: "
                                 f"{spec.unsupported_reason}")
    if spec.family not in PAGED_FAMILIES:
        raise KvbatchConfigError(f"model type '{spec.family}' is not supported by the paged cache "
                                 f"(supported: {', '.join(sorted(PAGED_FAMILIES))})")
    if mode not in KV_MODES:
        raise KvbatchConfigError(f"kv mode '{mode}' is unknown (choose one of {', '.join(KV_MODES)})")
    if mode != "none":
        if group_size not in GROUP_SIZES or spec.head_dim % group_size:
            raise KvbatchConfigError(f"kv.group_size={group_size} does not fit head size {spec.head_dim} "
                                     f"(use one of {GROUP_SIZES} that divides it)")
    ok = mode in VALIDATED.get((spec.family, spec.head_dim), frozenset())
    if mode == "none" and spec.family in PAGED_FAMILIES:
        ok = True  # the dense route has no head-size specific code
    if (ok and mode != "none" and name not in QUANT_VALIDATED_BACKENDS
            and not _cuda_quant_ok(spec, mode, group_size, options) and not allow_unvalidated):
        raise KvbatchConfigError(f"kv={mode} is not validated on the MLX {name} backend (see the README's "
                                 f"KV table); set kv.allow_unvalidated=true to run it anyway")
    if not ok and not allow_unvalidated:
        raise KvbatchConfigError(f"kv={mode} is not validated for {spec.family} with head size {spec.head_dim} "
                                 f"(see the README's KV table); set kv.allow_unvalidated=true to run it anyway")
