"""Which KV modes are validated for which model family and head size (fail closed).

Every entry here is exercised by tests/engine/test_kv_quant.py (q8/q4) and
tests/engine/test_kv_modes.py (k8v4, rotated keys, full-precision first tokens): teacher-forced
logits against a dequantize-and-attend reference, batched, at page sizes 16 and 64. A table
entry names a mode (by its key/value bits: none, q8, q4, k8v4) or an option that changes what is
stored (rotate_keys, full_precision_tokens): `rotate_keys` there means q8, q4 and k8v4 with
kv.rotate_keys=true are validated for that family and head size (the rotation sits at the cache's
edge, kv/cache.py, so every route sees the same rotated keys and queries); `full_precision_tokens`
the same for keeping each row's first N tokens dense (the copy is written at the cache's edge, read
by routes/quant.py; the fused CUDA decode kernel does not read it, so MLX CUDA refuses it).
"""
from __future__ import annotations

from typing import Optional

from kvbatch.engine.backend import backend
from kvbatch.engine.config import GROUP_SIZES, KV_MODES, EngineOptions, KVConfig, mode_name
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.kv.rotation import rotation_fits
from kvbatch.engine.kv.routes.select import fused_kernels
from kvbatch.engine.types import ModelSpec

# Families whose mlx-lm module routes attention through base.scaled_dot_product_attention
# and reads cache.offset for RoPE: the paged cache runs them unchanged.
PAGED_FAMILIES = frozenset({"llama", "qwen3", "qwen2", "mistral"})

_QUANT = frozenset({"none", "q8", "q4"})
_MODES = _QUANT | {"k8v4"}
# q8, q4, k8v4 with kv.rotate_keys=true and with kv.full_precision_tokens=N (not in the fused CUDA kernel)
_ROTATED = _MODES | {"rotate_keys", "full_precision_tokens"}
VALIDATED: dict[tuple[str, int], frozenset[str]] = {
    ("llama", 64): _ROTATED,
    ("llama", 128): _ROTATED,
    ("llama", 256): _QUANT,
    ("qwen3", 128): _ROTATED,
}
# Backends where the portable quantized route (mx.quantized_matmul) has been validated. On MLX
# CUDA (H200, mlx 0.32.4) it is not (docs/performance.md); there quantized modes are validated only
# where the fused kernel of routes/cuda_kernels.py runs decode (see `_cuda_quant_ok`).
QUANT_VALIDATED_BACKENDS = frozenset({"cpu", "metal"})


def _fused(spec: ModelSpec, kv: KVConfig, options: EngineOptions) -> bool:
    """Whether quantized decode runs the fused CUDA kernel here (routes/select.py)."""
    rep = max(spec.num_heads // max(spec.num_kv_heads, 1), 1)
    return fused_kernels(spec.head_dim, rep, kv.kv_bits, kv.group_size, options)


def _cuda_quant_ok(spec: ModelSpec, kv: KVConfig, options: EngineOptions) -> bool:
    """On MLX CUDA, quantized decode is validated through the fused kernel (benchmarks/gpu/backend_check.py)."""
    return backend().name == "cuda" and _fused(spec, kv, options)


def _unvalidated(kv: KVConfig, spec: ModelSpec, what: str) -> KvbatchConfigError:
    return KvbatchConfigError(f"{what} is not validated for {spec.family} with head size {spec.head_dim} "
                              f"(see the KV table in docs/kv-modes.md); set kv.allow_unvalidated=true to run it anyway")


def check_kv_mode(spec: ModelSpec, kv: KVConfig, options: Optional[EngineOptions] = None) -> None:
    """Raise KvbatchConfigError (one line) unless this model may run this KV config (with these
    engine options: the portable route has no fused CUDA kernel)."""
    options = options or EngineOptions()
    name, mode = backend().name, kv.mode
    if spec.unsupported_reason:
        raise KvbatchConfigError(f"model type '{spec.family}' is not supported by the paged cache: "
                                 f"{spec.unsupported_reason}")
    if spec.family not in PAGED_FAMILIES:
        raise KvbatchConfigError(f"model type '{spec.family}' is not supported by the paged cache "
                                 f"(supported: {', '.join(sorted(PAGED_FAMILIES))})")
    if mode not in KV_MODES:
        raise KvbatchConfigError(f"kv mode '{mode}' is unknown (choose one of {', '.join(KV_MODES)})")
    # the portable route reads bfloat16 pages in place with gather_mm, which MLX's CPU backend runs on float32 only
    # (Metal and CUDA take half precision too; float16 models take their scores in float32, gathered)
    if options.route == "portable" and name == "cpu" and spec.dtype == "bfloat16":
        raise KvbatchConfigError("engine.options.route=portable on the CPU cannot run bfloat16 weights (MLX's CPU "
                                 "gather_mm takes float32 only): set model.dtype=float32")
    if mode == "none":
        return  # the dense route has no head-size specific code
    if kv.group_size not in GROUP_SIZES or spec.head_dim % kv.group_size:
        raise KvbatchConfigError(f"kv.group_size={kv.group_size} does not fit head size {spec.head_dim} "
                                 f"(use one of {GROUP_SIZES} that divides it)")
    if kv.rotate_keys and not rotation_fits(spec.head_dim):
        raise KvbatchConfigError(f"kv.rotate_keys=true needs a head size that is a power of two (a Hadamard "
                                 f"rotation); this model's is {spec.head_dim}")
    if kv.full_precision_tokens and _fused(spec, kv, options):
        raise KvbatchConfigError("kv.full_precision_tokens is not built in the fused CUDA decode kernel "
                                 "(paged_cuda_qkernel); set it to 0 on MLX CUDA")
    label = mode_name(*kv.kv_bits)
    table = VALIDATED.get((spec.family, spec.head_dim), frozenset())
    if kv.allow_unvalidated:
        return
    if label not in table:
        raise _unvalidated(kv, spec, f"kv={label}")
    for key, on in (("rotate_keys", kv.rotate_keys), ("full_precision_tokens", kv.full_precision_tokens)):
        if on and key not in table:
            raise _unvalidated(kv, spec, f"kv.{key}={on!r}")
    if name not in QUANT_VALIDATED_BACKENDS and not _cuda_quant_ok(spec, kv, options):
        raise KvbatchConfigError(f"kv={kv.label} is not validated on the MLX {name} backend (see the KV table "
                                 f"in docs/kv-modes.md); set kv.allow_unvalidated=true to run it anyway")
