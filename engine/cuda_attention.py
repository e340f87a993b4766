"""Fused paged decode attention for MLX's CUDA backend (mx.fast.cuda_kernel).

The portable route gathers every row's pages into a contiguous copy each step and
then runs SDPA (dense) or quantized matmuls (q8/q4): the KV bytes cross memory
several times. These kernels read each row's pages in place through its page
table, once. A KV head's query group (GQA) is handled together so each K/V element
is loaded once; 8 head elements per lane (one 16-byte load for bf16, 8 or 4 bytes
of packed q8/q4), D/8 lanes per token, several tokens per warp; online softmax in
float32. Quantized pages are read as codes, with each group's scale and bias folded into
the dot products (engine/cuda_source.py, which holds the kernels' text); the row's dense
tail page is read from the tail buffer. In decode the kernel also stores the
step's new K/V (`new_kv`; kv_cache.PagedKVCache.kernel_writes): two scatters and their copies
per layer fewer for the host to launch.

Split-K (flash-decoding): a row longer than SPLIT_MIN tokens is split over several
blocks by token ranges of CHUNK tokens; each writes its partial (max, sum,
unnormalised output) and a second kernel merges the row's partials in order. The
ranges depend on the row's own length only, never on its batch mates (the longest
row, the batch size): a row's output is the same bits whichever rows share its
batch. (An unsplit row gives the same bits through either kernel: its one partial
is merged with weight exactly 1.) Decode only (one query per row); prefill keeps
the portable route. Tested against a float64 reference by benchmarks/backend_check.py.
"""
from __future__ import annotations

import hashlib
import os
from typing import NamedTuple

import mlx.core as mx

from kvbatch.engine.cuda_source import _REDUCE, kernel_source

NE = 8  # head elements per lane
# Per kernel kind: tokens per lane per loop step (KVBATCH_CUDA_UNROLL) and most warps per block
# (KVBATCH_CUDA_WARPS). q8/q4 take 4 warps x 4 tokens: their per-token loads are small (8 or 4
# bytes a lane), so more tokens in flight per lane pays, and half the warps halve the block's
# merge. Side by side on the H200 at 8k context (RESULTS.md, issue 9, seventh session): 1B
# batch 64 q8 1.13x / q4 1.08x none (1.03x / 1.01x with dense's 8 x 2), 8B batch 16 1.43x /
# 1.41x (1.37x / 1.39x); one-layer bench: 6% less time over 12 q8/q4 cells. Dense stays at
# 8 x 2 (4 x 4 was slower there).
UNROLL = {"dense": 2, "quant": 4}
WARPS = {"dense": 8, "quant": 4}
# Tokens per split: a row of more than SPLIT_MIN tokens runs ceil(its length / CHUNK) splits.
# Shorter rows are not split: the split path adds a kernel launch and partial buffers per layer,
# which at small batches (where a decode step is bound by the host's launches) is pure cost.
# 1024 (from 256): one layer at 8k context took 0.61-1.18x the time (most cases 0.78-0.94x; the
# exception, dense head 128 at batch 8) in a side-by-side bench of both on the H200 (RESULTS.md,
# issue 9, fifth session): fewer blocks, each amortising its merge over more tokens.
# KVBATCH_CUDA_CHUNK=N overrides both (splits of N tokens from N tokens on; 0 = never split).
CHUNK = 1024
SPLIT_MIN = 1024

_DENSE_INPUTS = ["q", "k", "v", "table", "lengths", "meta", "scale"]
_QUANT_INPUTS = ["q", "kw", "ks", "kb", "vw", "vs", "vb", "tk", "tv", "tails", "table", "lens", "meta", "scale"]


class Tuning(NamedTuple):
    """Launch settings, read once per cache (PagedKVCache) from the environment so that
    benchmarks can A/B them in one process: KVBATCH_CUDA_CHUNK (tokens per split),
    KVBATCH_CUDA_UNROLL (tokens per lane per loop step), KVBATCH_CUDA_WARPS (most warps per
    block, fewer where the merge buffers do not fit), both 0 = the kernel kind's default
    (UNROLL, WARPS), KVBATCH_CUDA_RAW (1: the lean loop of cuda_source._RAW_LOOP; 0: the float
    loop it replaced)."""
    chunk: int
    unsplit: int
    unroll: int
    warps: int
    raw: bool


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name, "").strip()
    return int(v) if v else default


def tuning() -> Tuning:
    chunk, unsplit = chunk_tokens()
    return Tuning(chunk, unsplit, _env_int("KVBATCH_CUDA_UNROLL", 0), _env_int("KVBATCH_CUDA_WARPS", 0),
                  _env_int("KVBATCH_CUDA_RAW", 1) != 0)


_kernels: dict = {}


def _kernel(kind: str, split: bool, new_kv: bool = False, raw: bool = True):
    """One compiled kernel per variant. The name carries a hash of the source: MLX caches
    compiled kernels on disk by name (/tmp/mlx/<version>/ptx), so a changed source must not
    reuse an old binary."""
    key = (kind, split, new_kv, raw)
    if key not in _kernels:
        if kind == "reduce":
            src, inputs, outputs = _REDUCE, ["pm", "pl", "pacc", "meta", "lens"], ["out"]
        else:
            q = kind == "quant"
            src = kernel_source(q, split, new_kv, raw)
            inputs = (_QUANT_INPUTS if q else _DENSE_INPUTS) + (["kn", "vn"] if new_kv else [])
            outputs = ["pm", "pl", "pacc"] if split else ["out"]
        tag = hashlib.sha1(src.encode()).hexdigest()[:12]
        _kernels[key] = mx.fast.cuda_kernel(name=f"kvbatch_{kind}{'_split' if split else ''}_{tag}",
                                            input_names=inputs, output_names=outputs, source=src)
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


def supports(head_dim: int, rep: int, bits: int | None = None, group_size: int | None = None) -> bool:
    """Whether the kernels handle this geometry (and quantization)."""
    if head_dim % NE or head_dim > 32 * NE or warps_for(head_dim, rep) == 0:
        return False
    return not bits or (bits in (4, 8) and group_size is not None and group_size % NE == 0
                        and head_dim % group_size == 0)


def available() -> bool:
    """MLX CUDA with custom kernels, unless KVBATCH_FUSED_ATTENTION=0 (the portable route then runs)."""
    if os.environ.get("KVBATCH_FUSED_ATTENTION", "1") == "0":
        return False
    return mx.cuda.is_available() and hasattr(mx.fast, "cuda_kernel")


def usable(layout, store, query_heads: int) -> bool:
    """On MLX CUDA, for head-major pages whose shapes the kernels handle."""
    if not available():
        return False
    rep = max(query_heads // layout.num_kv_heads, 1)
    if layout.bits:
        return supports(layout.head_dim, rep, layout.bits, layout.group_size)
    return getattr(store, "k", None) is not None and store.k[0].ndim == 4 and supports(layout.head_dim, rep)


def kernel_writes() -> bool:
    """Whether decode stores each step's new K/V inside the fused kernel (the token's slot is
    written by the thread that reads it) instead of two scatters per layer before it: fewer
    device ops per layer for the host to launch. KVBATCH_CUDA_KERNEL_WRITE=0 turns it off."""
    return os.environ.get("KVBATCH_CUDA_KERNEL_WRITE", "1") != "0"


def chunk_tokens() -> tuple[int, int]:
    """(tokens per split, longest unsplit row): KVBATCH_CUDA_CHUNK=N gives (N, N) (0: never
    split), N:M gives (N, M), else (CHUNK, SPLIT_MIN)."""
    env = os.environ.get("KVBATCH_CUDA_CHUNK", "").strip()
    if not env:
        return CHUNK, SPLIT_MIN
    n, _, m = env.partition(":")
    return int(n), int(m or n)


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


class _Launch(NamedTuple):
    """Everything a launch needs besides its arrays: the same for every layer of a decode step,
    so it is worked out once per step shape (`_launch_for`) instead of once per layer. The host
    builds and launches each step while the GPU waits at small batches (RESULTS.md, issue 9)."""
    kernel: object
    call: dict  # template, grid, threadgroup, output_shapes, output_dtypes
    consts: list  # [meta, scale]
    reduce: object  # the merge kernel (split rows), or None
    reduce_call: dict


_launches: dict = {}


def _launch_for(kind: str, B: int, Hq: int, D: int, dtype: mx.Dtype, store_dtype: mx.Dtype, kv_heads: int,
                page: int, max_tokens: int, maxp: int, scale: float, extra: tuple, chunk: int | None,
                new_kv: bool, tune: Tuning) -> _Launch:
    rep = Hq // kv_heads
    nw = warps_for(D, rep, tune.warps or WARPS[kind]) or warps_for(D, rep)  # fewer than 4 warps: the most that fit
    ns, chunk, unsplit = splits_for(max_tokens, *((chunk, chunk) if chunk is not None else tune[:2]))
    meta = _const((maxp, ns, chunk, unsplit), mx.int32)
    template = [("T", dtype), ("S", store_dtype), ("D", D), ("P", page), ("REP", rep), ("HKV", kv_heads),
                ("NW", nw), ("LPT", _lanes(D)), ("NE", NE), ("U", tune.unroll or UNROLL[kind])] + list(extra)
    call = dict(template=template, grid=(B * kv_heads * ns * 32 * nw, 1, 1), threadgroup=(32 * nw, 1, 1))
    consts = [meta, _const((float(scale),), mx.float32)]
    if ns == 1:
        return _Launch(_kernel(kind, False, new_kv, tune.raw),
                       dict(call, output_shapes=[(B, Hq, D)], output_dtypes=[dtype]), consts, None, {})
    n = B * kv_heads * ns * rep
    return _Launch(_kernel(kind, True, new_kv, tune.raw),
                   dict(call, output_shapes=[(n,), (n,), (n * D,)], output_dtypes=[mx.float32] * 3), consts,
                   _kernel("reduce", False),
                   dict(template=[("T", dtype), ("D", D), ("REP", rep), ("HKV", kv_heads),
                                  ("QL", int(kind == "quant"))],
                        grid=(B * kv_heads * 128, 1, 1), threadgroup=(128, 1, 1),
                        output_shapes=[(B, Hq, D)], output_dtypes=[dtype]))


def _launch(kind: str, inputs: list, q: mx.array, store_dtype: mx.Dtype, kv_heads: int, page: int,
            max_tokens: int, maxp: int, scale: float, extra: list, chunk: int | None,
            new_kv: tuple[mx.array, mx.array] | None, tune: Tuning | None) -> mx.array:
    B, Hq, _, D = q.shape
    tune = tune or tuning()
    key = (kind, B, Hq, D, q.dtype, store_dtype, kv_heads, page, max_tokens, maxp, scale, tuple(extra), chunk,
           new_kv is not None, tune)
    run = _launches.get(key)
    if run is None:
        if len(_launches) > 256:
            _launches.clear()
        run = _launches[key] = _launch_for(*key)
    args = [q.reshape(B, Hq, D)] + inputs + run.consts
    if new_kv is not None:
        args += [a.reshape(B, kv_heads, D).astype(store_dtype) for a in new_kv]
    if run.reduce is None:
        (out,) = run.kernel(inputs=args, **run.call)
    else:
        pm, pl, pacc = run.kernel(inputs=args, **run.call)
        (out,) = run.reduce(inputs=[pm, pl, pacc, run.consts[0], inputs[-1]], **run.reduce_call)  # lens last
    return out.reshape(B, Hq, 1, D)


def paged_decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array,
                           lengths: mx.array, scale: float, chunk: int | None = None,
                           new_kv: tuple[mx.array, mx.array] | None = None, tune: Tuning | None = None) -> mx.array:
    """q (B, Hq, 1, D); pools (pages, Hkv, P, D); table (B, maxp) int32; lengths (B,) int32
    (keys stored, the new token included) -> (B, Hq, 1, D). chunk: tokens per split (None:
    chunk_tokens(); 0: no split). new_kv: this step's (keys, values), (B, Hkv, 1, D), which
    the kernel stores into each row's slot len - 1 (then not stored before the call).
    tune: launch settings (None: tuning(), read from the environment now)."""
    _, Hkv, P, _ = k_pool.shape
    maxp = table.shape[1]
    inputs = [k_pool, v_pool, table.astype(mx.int32), lengths.astype(mx.int32)]
    return _launch("dense", inputs, q, k_pool.dtype, Hkv, P, maxp * P, maxp, scale, [], chunk, new_kv, tune)


def paged_decode_attention_quantized(q: mx.array, packed: list[mx.array], tail_k: mx.array, tail_v: mx.array,
                                     tails: mx.array, table: mx.array, lens: mx.array, scale: float, bits: int,
                                     group_size: int, chunk: int | None = None,
                                     new_kv: tuple[mx.array, mx.array] | None = None,
                                     tune: Tuning | None = None) -> mx.array:
    """q (B, Hq, 1, D); packed: [k_w, k_scales, k_biases, v_w, v_scales, v_biases], each
    (pages, Hkv, P, width); tail_k/v (slots, Hkv, P, D); tails (B,) the rows' tail slots;
    table (B, maxp) the sealed pages; lens (B, 2) int32: tokens on sealed pages and in the
    tail (the new token included) -> (B, Hq, 1, D). chunk, new_kv, tune as in paged_decode_attention
    (new_kv: stored into the tail pages)."""
    _, Hkv, P, _ = tail_k.shape
    maxp = table.shape[1]
    inputs = [packed[0], packed[1], packed[2], packed[3], packed[4], packed[5], tail_k, tail_v,
              tails.astype(mx.int32), table.astype(mx.int32), lens.astype(mx.int32)]
    return _launch("quant", inputs, q, tail_k.dtype, Hkv, P, maxp * P + P, maxp, scale,
                   [("BITS", bits), ("GS", group_size)], chunk, new_kv, tune)
