"""Fused paged decode attention for MLX's CUDA backend (mx.fast.cuda_kernel).

The portable route gathers every row's pages into a contiguous copy each step and
then runs SDPA (dense) or quantized matmuls (q8/q4): the KV bytes cross memory
several times. These kernels read each row's pages in place through its page
table, once. A KV head's query group (GQA) is handled together so each K/V element
is loaded once; 8 head elements per lane (one 16-byte load for bf16, 8 or 4 bytes
of packed q8/q4), D/8 lanes per token, several tokens per warp; online softmax in
float32. Quantized pages are read as codes, with each group's scale and bias folded into
the dot products (routes/cuda_source.py holds the kernels' text); the row's dense
tail page is read from the tail buffer. In decode the kernel can also store the
step's new K/V (`new_kv`; CudaLaunch.kernel_writes): two scatters and their copies
per layer fewer for the host to launch.

Split-K (flash-decoding): a row longer than `unsplit` tokens is split over several
blocks by token ranges of `chunk` tokens; each writes its partial (max, sum,
unnormalised output) and a second kernel merges the row's partials in order. The
ranges depend on the row's own length only, never on its batch mates: a row's output
is the same bits whichever rows share its batch. (An unsplit row gives the same bits
through either kernel: its one partial is merged with weight exactly 1.) Decode only
(one query per row); prefill keeps the portable route. Tested against a float64
reference by benchmarks/gpu/backend_check.py.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, cast

import mlx.core as mx

from kvbatch.engine.config import CudaLaunch
from kvbatch.engine.kv.routes.cuda_source import _REDUCE, kernel_source

NE = 8  # head elements per lane
# Per kernel kind: tokens per lane per loop step and most warps per block (CudaLaunch.unroll /
# warps override both kinds). q8/q4 take 4 warps x 4 tokens: their per-token loads are small (8 or
# 4 bytes a lane), so more tokens in flight per lane pays, and half the warps halve the block's
# merge; dense stays at 8 x 2 (measured side by side on the H200: docs/performance.md).
UNROLL = {"dense": 2, "quant": 4}
WARPS = {"dense": 8, "quant": 4}

_DENSE_INPUTS = ["q", "k", "v", "table", "lengths", "meta", "scale"]
_QUANT_INPUTS = ["q", "kw", "ks", "kb", "vw", "vs", "vb", "tk", "tv", "tails", "table", "lens", "meta", "scale"]

# mx.fast.cuda_kernel's object: called with inputs= and the launch's keywords, returns the outputs
_Kernel = Callable[..., list[mx.array]]
_kernels: dict[tuple, _Kernel] = {}


def _kernel(kind: str, split: bool, new_kv: bool = False) -> _Kernel:
    """One compiled kernel per variant. The name carries a hash of the source: MLX caches
    compiled kernels on disk by name (/tmp/mlx/<version>/ptx), so a changed source must not
    reuse an old binary."""
    key = (kind, split, new_kv)
    if key not in _kernels:
        if kind == "reduce":
            src, inputs, outputs = _REDUCE, ["pm", "pl", "pacc", "meta", "lens"], ["out"]
        else:
            q = kind == "quant"
            src = kernel_source(q, split, new_kv)
            inputs = (_QUANT_INPUTS if q else _DENSE_INPUTS) + (["kn", "vn"] if new_kv else [])
            outputs = ["pm", "pl", "pacc"] if split else ["out"]
        tag = hashlib.sha1(src.encode()).hexdigest()[:12]
        kernel = mx.fast.cuda_kernel(name=f"kvbatch_{kind}{'_split' if split else ''}_{tag}",
                                     input_names=inputs, output_names=outputs, source=src)
        _kernels[key] = cast(_Kernel, kernel)  # mlx's stub says `object`: it is the callable kernel
    return _kernels[key]


def _lanes(head_dim: int) -> int:
    lpt = 1
    while lpt * NE < head_dim:
        lpt *= 2
    return lpt


def warps_for(head_dim: int, rep: int, most: int = 8) -> int:
    """Warps per block (at most `most`) whose merge buffers fit in static shared memory (0: none do)."""
    for nw in (8, 4):  # (2 warps would fit larger groups; not run on a GPU)
        if nw <= most and nw * rep * (head_dim + 2) * 4 <= 44 * 1024:
            return nw
    return 0


def supports(head_dim: int, rep: int, bits: int | tuple | None = None, group_size: int | None = None) -> bool:
    """Whether the kernels handle this geometry (and quantization: bits of keys and values alike,
    or (key bits, value bits); None: dense)."""
    if head_dim % NE or head_dim > 32 * NE or warps_for(head_dim, rep) == 0:
        return False
    both = (bits, bits) if isinstance(bits, int) or bits is None else tuple(bits)
    if both[0] is None:
        return True
    return (all(b in (4, 8) for b in both) and group_size is not None and group_size % NE == 0
            and head_dim % group_size == 0)


def splits_for(max_tokens: int, chunk: int, unsplit: int) -> tuple[int, int, int]:
    """(splits of the longest row = blocks per (row, KV head), tokens per split, longest
    unsplit row). A row splits only if it is longer than `unsplit` (and than `chunk`), into
    ceil(its own length / chunk) ranges: the split ranges never depend on batch mates."""
    if chunk <= 0 or max_tokens <= max(chunk, unsplit):
        return 1, max(max_tokens, 1), 0
    return -(-max_tokens // chunk), chunk, unsplit


_consts: dict = {}


def _const(values: tuple, dtype) -> mx.array:
    """Small per-call constants (meta, scale), made once per value: a decode step has the
    same ones in every layer, and each new mx.array is a host-to-device copy."""
    key = (values, dtype)
    a = _consts.get(key)
    if a is None:
        if len(_consts) > 256:
            _consts.clear()
        a = _consts[key] = mx.array(list(values), dtype=dtype)
    return a


@dataclass(frozen=True)
class _Geometry:
    """What fixes a launch besides the query's shape: the same for every layer of a decode step."""

    store_dtype: mx.Dtype
    kv_heads: int
    page: int
    max_tokens: int  # the longest row's keys (its pages, and for q8/q4 its tail page)
    maxp: int  # page-table width
    scale: float
    extra: tuple  # template constants of the kind (KBITS, VBITS, GS for quantized pages)


class QuantPages(NamedTuple):
    """A layer's q8/q4 pages as the quantized kernel reads them."""

    packed: list  # [k_w, k_scales, k_biases, v_w, v_scales, v_biases], each (pages, Hkv, P, width)
    tail_k: mx.array  # (slots, Hkv, P, D): the rows' dense tail pages
    tail_v: mx.array
    key_bits: int
    group_size: int
    value_bits: int = 0  # 0: key_bits


class _Launch(NamedTuple):
    """Everything a launch needs besides its arrays, worked out once per step shape (`_launch_for`)
    instead of once per layer: the host builds and launches each step while the GPU waits at small
    batches (docs/performance.md)."""
    kernel: _Kernel
    call: dict  # template, grid, threadgroup, output_shapes, output_dtypes
    consts: list  # [meta, scale]
    reduce: Optional[_Kernel]  # the merge kernel (split rows), or None
    reduce_call: dict


_launches: dict = {}


def _launch_for(kind: str, B: int, Hq: int, D: int, dtype: mx.Dtype, g: _Geometry, new_kv: bool,
                launch: CudaLaunch) -> _Launch:
    rep = Hq // g.kv_heads
    nw = warps_for(D, rep, launch.warps or WARPS[kind]) or warps_for(D, rep)  # fewer than 4 warps: the most that fit
    ns, chunk, unsplit = splits_for(g.max_tokens, launch.chunk, launch.unsplit)
    meta = _const((g.maxp, ns, chunk, unsplit), mx.int32)
    template = [("T", dtype), ("S", g.store_dtype), ("D", D), ("P", g.page), ("REP", rep), ("HKV", g.kv_heads),
                ("NW", nw), ("LPT", _lanes(D)), ("NE", NE), ("U", launch.unroll or UNROLL[kind])] + list(g.extra)
    call = dict(template=template, grid=(B * g.kv_heads * ns * 32 * nw, 1, 1), threadgroup=(32 * nw, 1, 1))
    consts = [meta, _const((float(g.scale),), mx.float32)]
    if ns == 1:
        return _Launch(_kernel(kind, False, new_kv),
                       dict(call, output_shapes=[(B, Hq, D)], output_dtypes=[dtype]), consts, None, {})
    n = B * g.kv_heads * ns * rep
    return _Launch(_kernel(kind, True, new_kv),
                   dict(call, output_shapes=[(n,), (n,), (n * D,)], output_dtypes=[mx.float32] * 3), consts,
                   _kernel("reduce", False),
                   dict(template=[("T", dtype), ("D", D), ("REP", rep), ("HKV", g.kv_heads),
                                  ("QL", int(kind == "quant"))],
                        grid=(B * g.kv_heads * 128, 1, 1), threadgroup=(128, 1, 1),
                        output_shapes=[(B, Hq, D)], output_dtypes=[dtype]))


def _launch(kind: str, inputs: list, q: mx.array, g: _Geometry, launch: CudaLaunch,
            new_kv: Optional[tuple[mx.array, mx.array]]) -> mx.array:
    B, Hq, _, D = q.shape
    key = (kind, B, Hq, D, q.dtype, g, new_kv is not None, launch.chunk, launch.unsplit, launch.unroll, launch.warps)
    run = _launches.get(key)
    if run is None:
        if len(_launches) > 256:
            _launches.clear()
        run = _launches[key] = _launch_for(kind, B, Hq, D, q.dtype, g, new_kv is not None, launch)
    args = [q.reshape(B, Hq, D)] + inputs + run.consts
    if new_kv is not None:
        args += [a.reshape(B, g.kv_heads, D).astype(g.store_dtype) for a in new_kv]
    if run.reduce is None:
        (out,) = run.kernel(inputs=args, **run.call)
    else:
        pm, pl, pacc = run.kernel(inputs=args, **run.call)
        (out,) = run.reduce(inputs=[pm, pl, pacc, run.consts[0], inputs[-1]], **run.reduce_call)  # lens last
    return out.reshape(B, Hq, 1, D)


def paged_decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array,
                           scale: float, launch: CudaLaunch,
                           new_kv: Optional[tuple[mx.array, mx.array]] = None) -> mx.array:
    """q (B, Hq, 1, D); pools (pages, Hkv, P, D); table (B, maxp) int32; lengths (B,) int32
    (keys stored, the new token included) -> (B, Hq, 1, D). new_kv: this step's (keys, values),
    (B, Hkv, 1, D), which the kernel stores into each row's slot len - 1 (then not stored
    before the call)."""
    _, Hkv, P, _ = k_pool.shape
    maxp = table.shape[1]
    g = _Geometry(k_pool.dtype, Hkv, P, maxp * P, maxp, scale, ())
    return _launch("dense", [k_pool, v_pool, table.astype(mx.int32), lengths.astype(mx.int32)], q, g, launch, new_kv)


def paged_decode_attention_quantized(q: mx.array, pages: QuantPages, tails: mx.array, table: mx.array,
                                     lens: mx.array, scale: float, launch: CudaLaunch,
                                     new_kv: Optional[tuple[mx.array, mx.array]] = None) -> mx.array:
    """q (B, Hq, 1, D); tails (B,) the rows' tail slots; table (B, maxp) the sealed pages; lens
    (B, 2) int32: tokens on sealed pages and in the tail (the new token included) -> (B, Hq, 1, D).
    new_kv as in paged_decode_attention (stored into the tail pages)."""
    _, Hkv, P, _ = pages.tail_k.shape
    maxp = table.shape[1]
    g = _Geometry(pages.tail_k.dtype, Hkv, P, maxp * P + P, maxp, scale,
                  (("KBITS", pages.key_bits), ("VBITS", pages.value_bits or pages.key_bits),
                   ("GS", pages.group_size)))
    inputs = [*pages.packed, pages.tail_k, pages.tail_v, tails.astype(mx.int32), table.astype(mx.int32),
              lens.astype(mx.int32)]
    return _launch("quant", inputs, q, g, launch, new_kv)
