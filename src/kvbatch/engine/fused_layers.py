"""Llama-family decoder layers in fewer kernels a pass (`engine.options.fused_layers`).

mlx-lm's llama layer launches ~15 kernels a forward pass: two RMSNorms and two residual adds, q, k and v
projections and two RoPEs, the attention, the output projection, gate and up projections, SwiGLU and down.
On MLX CUDA each launch costs the host tens of microseconds, and at large batches of a small model (SmolLM2's
30 layers: ~450 launches a step) the host's launches take longer than the GPU's work, so the GPU waits. Here a
layer runs in 9:

- the residual add and the RMSNorm after it in one kernel (`add_norm`: the sum and its norm), the last
  layer's add with the model's final norm;
- q, k and v in one matmul over their weights concatenated, then one kernel (`rope_split`) that rotates q and
  k by RoPE and lays q, k and v out by head, as the attention reads them;
- gate and up in one matmul over their weights concatenated, then one SwiGLU kernel over its two halves.

The concatenated weights are made once when the model is prepared; the separate projections' weights become
views of them, so no memory is added and mlx-lm's own forward still runs on the same model. A pass runs fused
only while every layer is one this module recognizes with those weights in place (a LoRA adapter or reloaded
weights put the model back on mlx-lm's forward). The kernels are MLX CUDA's (`mx.fast.cuda_kernel`); on other
backends (the option forced on, as the CPU tests do) the same steps are composed from MLX's ops. The results
are those of mlx-lm's layers up to rounding: a matmul over concatenated weights may pick another kernel.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvbatch.engine.backend import backend
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.kv.cache import PagedLayerCache

logger = logging.getLogger(__name__)

__all__ = ["install", "installed", "uninstall", "wanted"]

# one block per row of the hidden states: x + r rounded to the model's dtype (as the separate add gives it),
# then RMSNorm of that sum in float32, scaled by the norm's weight
ADD_NORM = r"""
    const size_t base = (size_t)blockIdx.x * H;
    const int tid = threadIdx.x;
    float ss = 0.f;
    for (int j = tid; j < H; j += blockDim.x) {
        const T hv = static_cast<T>(static_cast<float>(x[base + j]) + static_cast<float>(r[base + j]));
        h[base + j] = hv;
        const float f = static_cast<float>(hv);
        ss += f * f;
    }
    __shared__ float red[32];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if ((tid & 31) == 0) red[tid >> 5] = ss;
    __syncthreads();
    if (tid < 32) {
        float v = tid < (int)(blockDim.x >> 5) ? red[tid] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        if (tid == 0) red[0] = v;
    }
    __syncthreads();
    const float inv = rsqrtf(red[0] / H + eps[0]);
    for (int j = tid; j < H; j += blockDim.x) {
        n[base + j] = static_cast<T>(static_cast<float>(h[base + j]) * inv * static_cast<float>(w[j]));
    }
"""

# one thread per (row, position, head of q|k|v, rotation pair): the fused projection's output (B * L, (HQ + 2 HKV)
# * D) -> q (B, HQ, L, D) and k (B, HKV, L, D) rotated at position offs[b] + l, v (B, HKV, L, D) as it is.
# TRAD: pairs (2i, 2i + 1), else (i, i + D / 2); inv: the inverse frequencies (RoPE's scale folded in)
ROPE_SPLIT = r"""
    constexpr int HALF = D / 2, HT = HQ + 2 * HKV;
    const int L = meta[2];  // a pass's positions a row: an argument, not a template constant (one kernel)
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)meta[0] * L * HT * HALF) return;
    const int i = idx % HALF;
    const size_t t = idx / HALF;
    const int hd = t % HT;
    const size_t bl = t / HT;
    const int b = bl / L, l = bl % L;
    const size_t src = bl * (HT * D) + (size_t)hd * D;
    const int i1 = TRAD ? 2 * i : i, i2 = TRAD ? 2 * i + 1 : i + HALF;
    T o1 = qkv[src + i1], o2 = qkv[src + i2];
    if (hd < HQ + HKV) {
        const float th = static_cast<float>(offs[meta[1] ? b : 0] + l) * inv[i];
        float s, c;
        sincosf(th, &s, &c);
        const float x1 = static_cast<float>(o1), x2 = static_cast<float>(o2);
        o1 = static_cast<T>(x1 * c - x2 * s);
        o2 = static_cast<T>(x1 * s + x2 * c);
    }
    T* dst;
    if (hd < HQ) dst = q + (((size_t)b * HQ + hd) * L + l) * D;
    else if (hd < HQ + HKV) dst = k + (((size_t)b * HKV + hd - HQ) * L + l) * D;
    else dst = v + (((size_t)b * HKV + hd - HQ - HKV) * L + l) * D;
    dst[i1] = o1;
    dst[i2] = o2;
"""

# one thread per output element: silu(gate) * up, gate and up the two halves of the fused projection's row
SWIGLU = r"""
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)meta[0] * I) return;
    const size_t row = idx / I, j = idx % I;
    const float g = static_cast<float>(gu[row * 2 * I + j]), u = static_cast<float>(gu[row * 2 * I + I + j]);
    a[idx] = static_cast<T>(g / (1.f + __expf(-g)) * u);
"""

KERNELS = {"add_norm": (ADD_NORM, ["x", "r", "w", "eps"], ["h", "n"]),
           "rope_split": (ROPE_SPLIT, ["qkv", "offs", "inv", "meta"], ["q", "k", "v"]),
           "swiglu": (SWIGLU, ["gu", "meta"], ["a"])}
_compiled: dict[str, Callable[..., list[mx.array]]] = {}


def _kernel(name: str) -> Callable[..., list[mx.array]]:
    """The compiled kernel; its name carries a hash of the source (MLX caches compiled kernels by name)."""
    if name not in _compiled:
        src, inputs, outputs = KERNELS[name]
        tag = hashlib.sha1(src.encode()).hexdigest()[:12]
        _compiled[name] = cast(Callable[..., list[mx.array]], mx.fast.cuda_kernel(
            name=f"kvbatch_{name}_{tag}", input_names=inputs, output_names=outputs, source=src))
    return _compiled[name]


@dataclass
class _Layer:
    """One layer's fused weights and what the fused forward needs of it."""

    qkv: mx.array  # (Hq + 2 Hkv) * D rows: q's, k's, v's weights
    gate_up: mx.array  # 2 I rows: gate's, up's
    heads: int
    kv_heads: int
    head_dim: int
    traditional: bool  # RoPE's pairs: (2i, 2i + 1), else (i, i + D / 2)
    inv_freq: Optional[mx.array]  # RoPE's inverse frequencies (scale folded in); None: composed from MLX's ops


@dataclass
class _Fused:
    """What install() made: the layers' fused weights and the model class it swapped."""

    layers: list[_Layer]
    base: type
    # (module, key, what it held when fused): the projections in their layers, the fused weights in them
    watched: list[tuple[dict, str, Any]]


# passes of at most this many tokens a row run fused: decode steps and verification windows, whose kernel
# launches outlast the GPU's work; longer (prefill) passes are the GPU's work and run mlx-lm's layers
MOST_TOKENS = 16
_MARK = "_kvbatch_fused"
_classes: dict[type, type] = {}


def _plain_linear(m: Any) -> bool:
    return type(m) is nn.Linear and "bias" not in m


def _inverse_frequencies(rope: Any, dims: int) -> Optional[np.ndarray]:
    """RoPE's inverse frequencies for the rope_split kernel, for MLX's plain RoPE and mlx-lm's Llama 3 RoPE
    over the whole head; None for any other (its layer is not fused)."""
    if getattr(rope, "dims", None) != dims:
        return None
    if type(rope) is nn.RoPE:
        return (float(rope.scale) * float(rope.base) ** (-np.arange(0, dims, 2, dtype=np.float64) / dims))
    if type(rope).__name__ == "Llama3RoPE" and hasattr(rope, "_freqs"):
        return 1.0 / np.array(rope._freqs, dtype=np.float64)
    return None


def _fusable(inner: nn.Module) -> bool:
    """Whether the model is mlx-lm's llama model with plain layers: full attention, bias-free projections,
    RMSNorms, a SwiGLU MLP and a RoPE rope_split computes."""
    from mlx_lm.models import llama

    if type(inner) is not llama.LlamaModel or inner.sliding_window is not None:
        return False
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        if (type(layer) is not llama.TransformerBlock or layer.use_sliding or type(a) is not llama.Attention
                or type(m) is not llama.MLP
                or not all(_plain_linear(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                      m.gate_proj, m.up_proj, m.down_proj))
                or type(layer.input_layernorm) is not nn.RMSNorm
                or type(layer.post_attention_layernorm) is not nn.RMSNorm
                or _inverse_frequencies(a.rope, a.head_dim) is None):
            return False
    return type(inner.norm) is nn.RMSNorm


def _fuse(layer: Any, kernels: bool) -> _Layer:
    """Concatenate a layer's q/k/v and gate/up weights; the separate weights become views of them."""
    a, m = layer.self_attn, layer.mlp
    qkv = mx.concatenate([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], axis=0)
    gate_up = mx.concatenate([m.gate_proj.weight, m.up_proj.weight], axis=0)
    mx.eval(qkv, gate_up)
    nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
    ni = m.gate_proj.weight.shape[0]
    a.q_proj.weight, a.k_proj.weight, a.v_proj.weight = qkv[:nq], qkv[nq:nq + nk], qkv[nq + nk:]
    m.gate_proj.weight, m.up_proj.weight = gate_up[:ni], gate_up[ni:]
    inv = _inverse_frequencies(a.rope, a.head_dim)
    return _Layer(qkv, gate_up, a.n_heads, a.n_kv_heads, a.head_dim, bool(a.rope.traditional),
                  mx.array(inv.astype(np.float32)) if kernels and inv is not None else None)


def _watch(inner: Any) -> list[tuple[dict, str, Any]]:
    """What `_in_place` checks: each layer's seven projections and the five fused weights they hold."""
    out: list[tuple[dict, str, Any]] = []
    for layer in inner.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "down_proj", "up_proj"))):
            for name in names:
                out.append((parent, name, parent[name]))
                if name not in ("o_proj", "down_proj"):
                    out.append((parent[name], "weight", parent[name]["weight"]))
    return out


def wanted(options: EngineOptions) -> bool:
    """Whether the options ask for fused layers on this backend (auto: MLX CUDA's own route)."""
    if options.fused_layers == "auto":
        return backend().cuda_kernels and options.route == "auto"
    return options.fused_layers == "on"


def install(model: nn.Module) -> bool:
    """Run the model's llama layers fused (idempotent). False: the model is not one this module fuses."""
    inner = getattr(model, "model", None)
    if inner is None:
        return False
    if getattr(inner, _MARK, None) is not None:
        return True
    if not _fusable(inner):
        return False
    kernels = backend().cuda_kernels
    layers = [_fuse(layer, kernels) for layer in inner.layers]
    base = type(inner)
    if base not in _classes:
        _classes[base] = type(f"Fused{base.__name__}", (base,), {"__call__": _forward})
    object.__setattr__(inner, _MARK, _Fused(layers, base, _watch(inner)))
    inner.__class__ = _classes[base]
    logger.info("fused layers: %d llama layers in fewer kernels (%s)", len(layers),
                "MLX CUDA kernels" if kernels else "MLX ops")
    return True


def uninstall(model: nn.Module) -> None:
    """Put mlx-lm's forward back (the projections' weights stay views of the concatenations: the same values)."""
    inner = getattr(model, "model", None)
    fused = getattr(inner, _MARK, None) if inner is not None else None
    if fused is not None:
        inner.__class__ = fused.base
        object.__setattr__(inner, _MARK, None)


def installed(model: nn.Module) -> bool:
    """Whether the model's forward is the fused one."""
    inner = getattr(model, "model", None)
    return inner is not None and getattr(inner, _MARK, None) is not None


def _in_place(fused: _Fused) -> bool:
    """Whether every layer still has the modules and weights it was fused with (no adapter, no reload since):
    identity checks on the modules' own dicts, cheap enough for every pass."""
    return all(parent[key] is child for parent, key, child in fused.watched)


@dataclass
class _Pass:
    """What every layer's kernels of one pass share, made once a pass: the rows' RoPE offsets and the sizes
    the kernels' guards read (kernel arguments, so no size compiles a kernel of its own)."""

    offsets: mx.array  # (B,) int32, or (1,) for one offset for every row
    rope_meta: mx.array  # [B, whether offsets has one per row, L]
    rows_meta: mx.array  # [B * L]

    @staticmethod
    def of(B: int, L: int, offset: Any) -> "_Pass":
        per_row = isinstance(offset, mx.array) and offset.size > 1
        offs = (offset.astype(mx.int32).reshape(-1) if isinstance(offset, mx.array)
                else mx.array([int(offset)], dtype=mx.int32))
        return _Pass(offs, mx.array([B, int(per_row), L], dtype=mx.int32), mx.array([B * L], dtype=mx.int32))


@functools.cache
def _scalar(value: float) -> mx.array:
    """A float32 constant a kernel reads (one array for every call: the norms share their epsilon)."""
    return mx.array([value], dtype=mx.float32)


def _forward(self: Any, inputs: mx.array, cache: Optional[Sequence[Any]] = None,
             input_embeddings: Optional[mx.array] = None) -> mx.array:
    """The llama model's forward with fused layers (the paged cache's passes); mlx-lm's otherwise."""
    fused: _Fused = getattr(self, _MARK)
    tokens = (inputs if input_embeddings is None else input_embeddings).shape[1]
    if (cache is None or tokens > MOST_TOKENS or not all(isinstance(c, PagedLayerCache) for c in cache)
            or not _in_place(fused)):
        return fused.base.__call__(self, inputs, cache=cache, input_embeddings=input_embeddings)
    h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
    layers = self.layers
    kernels = fused.layers[0].inv_freq is not None
    p = _Pass.of(h.shape[0], h.shape[1], cache[0].offset) if kernels else None
    n = mx.fast.rms_norm(h, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
    r: Optional[mx.array] = None
    for layer, f, c in zip(layers, fused.layers, cache):
        if r is not None:
            h, n = _add_norm(h, r, layer.input_layernorm, kernels)
        h, n = _add_norm(h, _attention(layer.self_attn, f, n, c, p), layer.post_attention_layernorm, kernels)
        r = layer.mlp.down_proj(_swiglu(n @ f.gate_up.T, f.gate_up.shape[0] // 2, p))
    assert r is not None
    return _add_norm(h, r, self.norm, kernels)[1]


def _add_norm(x: mx.array, r: mx.array, norm: Any, kernels: bool) -> tuple[mx.array, mx.array]:
    """(x + r, RMSNorm(x + r)), in one kernel on MLX CUDA."""
    if not kernels:
        h = x + r
        return h, mx.fast.rms_norm(h, norm.weight, norm.eps)
    H = x.shape[-1]
    h, n = _kernel("add_norm")(inputs=[x, r, norm.weight, _scalar(float(norm.eps))],
                               template=[("T", x.dtype), ("H", H)], grid=(x.size // H * 256, 1, 1),
                               threadgroup=(256, 1, 1), output_shapes=[x.shape, x.shape],
                               output_dtypes=[x.dtype, x.dtype])
    return h, n


def _attention(a: Any, f: _Layer, x: mx.array, cache: Any, p: Optional[_Pass]) -> mx.array:
    """The attention block from the normed states: one q/k/v matmul, RoPE and the heads' layout in one kernel,
    the paged cache's write and attention (what mlx-lm's layer reaches through its cache), the output projection."""
    B, L, _ = x.shape
    qkv = x @ f.qkv.T
    if p is None:
        nq, nk = f.heads * f.head_dim, f.kv_heads * f.head_dim
        q = qkv[..., :nq].reshape(B, L, f.heads, -1).transpose(0, 2, 1, 3)
        k = qkv[..., nq:nq + nk].reshape(B, L, f.kv_heads, -1).transpose(0, 2, 1, 3)
        v = qkv[..., nq + nk:].reshape(B, L, f.kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = a.rope(q, offset=cache.offset), a.rope(k, offset=cache.offset)
    else:
        q, k, v = _rope_split(qkv, f, p)
    cache.update_and_fetch(k, v)
    out = cache.paged_attend(q, a.scale)
    return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _rope_split(qkv: mx.array, f: _Layer, p: _Pass) -> tuple[mx.array, mx.array, mx.array]:
    """q and k rotated at each row's positions, and v, by head: (B, heads, L, D) each, from (B, L, ·)."""
    B, L, _ = qkv.shape
    D = f.head_dim
    threads = B * L * (f.heads + 2 * f.kv_heads) * (D // 2)
    assert f.inv_freq is not None
    q, k, v = _kernel("rope_split")(
        inputs=[qkv, p.offsets, f.inv_freq, p.rope_meta],
        template=[("T", qkv.dtype), ("HQ", f.heads), ("HKV", f.kv_heads), ("D", D), ("TRAD", int(f.traditional))],
        grid=(-(-threads // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(B, f.heads, L, D), (B, f.kv_heads, L, D), (B, f.kv_heads, L, D)],
        output_dtypes=[qkv.dtype] * 3)
    return q, k, v


def _swiglu(gu: mx.array, inter: int, p: Optional[_Pass]) -> mx.array:
    """silu(gate) * up of the fused gate/up projection's output (..., 2 I) -> (..., I)."""
    if p is None:
        from mlx_lm.models.activations import swiglu

        return swiglu(gu[..., :inter], gu[..., inter:])
    rows = gu.size // (2 * inter)
    return _kernel("swiglu")(inputs=[gu, p.rows_meta], template=[("T", gu.dtype), ("I", inter)],
                             grid=(-(-rows * inter // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                             output_shapes=[(*gu.shape[:-1], inter)], output_dtypes=[gu.dtype])[0]
