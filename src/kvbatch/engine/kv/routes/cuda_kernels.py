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
from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from kvbatch.engine.config import CudaLaunch
from kvbatch.engine.kv.routes.cuda_build import KernelBuild
from kvbatch.engine.kv.routes.cuda_source import SEAL, kernel_source, mma_quant_source, mma_source, reduce_source

NE = 8  # head elements per lane
# Per kernel kind: tokens per lane per loop step and most warps per block (CudaLaunch.unroll /
# warps override both kinds). q8/q4 take 4 warps x 4 tokens: their per-token loads are small (8 or
# 4 bytes a lane), so more tokens in flight per lane pays, and half the warps halve the block's
# merge; dense stays at 8 x 2 (measured side by side on the H200: docs/performance.md).
UNROLL = {"dense": 2, "quant": 4}
WARPS = {"dense": 8, "quant": 4}

_DENSE_INPUTS = ["q", "k", "v", "table", "lengths", "meta", "scale"]
_QUANT_INPUTS = ["q", "kw", "ks", "kb", "vw", "vs", "vb", "tk", "tv", "tails", "table", "pos", "meta", "scale"]
_WINDOW_INPUTS = ["q", "k", "v", "table", "firsts", "lengths", "meta", "scale"]
_SEAL_INPUTS = ["a", "kw", "ks", "kb", "vw", "vs", "vb", "tk", "tv", "tails", "table", "pos", "meta"]

_kernels: dict[tuple, KernelBuild] = {}


def _kernel(kind: str, split: bool, new_kv: bool = False) -> KernelBuild:
    """One compiled kernel per variant (kind: dense, quant; mma_{decode,window}_{bf16,f16}: decode and
    verification windows on the tensor cores; mma_quant_{bf16,f16}: q8 decode on the tensor cores; reduce,
    reduce_window: the merges of split rows; seal: q8/q4 tail pages quantized into the pool). The name carries
    a hash of the source; cuda_build.KernelBuild keeps each variant's binary on disk by a hash of its whole
    text, so a changed source never reuses an old binary."""
    key = (kind, split, new_kv)
    if key not in _kernels:
        if kind == "seal":
            src, inputs, outputs = SEAL, _SEAL_INPUTS, ["o"]
        elif kind.startswith("mma_quant"):
            src = mma_quant_source(split, kind.endswith("_f16"), new_kv)
            inputs = _QUANT_INPUTS + (["kn", "vn"] if new_kv else [])
            outputs = ["pm", "pl", "pacc"] if split else ["out"]
        elif kind.startswith("mma"):
            window = kind.startswith("mma_window")
            src = mma_source(split, kind.endswith("_f16"), window, new_kv)
            inputs = _WINDOW_INPUTS if window else _DENSE_INPUTS + (["kn", "vn"] if new_kv else [])
            outputs = ["pm", "pl", "pacc"] if split else ["out"]
        elif kind.startswith("reduce"):
            src, inputs, outputs = reduce_source(kind == "reduce_window"), ["pm", "pl", "pacc", "meta", "lens"], ["out"]
        else:
            q = kind == "quant"
            src = kernel_source(q, split, new_kv)
            inputs = (_QUANT_INPUTS if q else _DENSE_INPUTS) + (["kn", "vn"] if new_kv else [])
            outputs = ["pm", "pl", "pacc"] if split else ["out"]
        tag = hashlib.sha1(src.encode()).hexdigest()[:12]
        _kernels[key] = KernelBuild(f"kvbatch_{kind}{'_split' if split else ''}_{tag}", inputs, outputs, src)
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
    batches (docs/performance.md). The kernels are bound to their variant (KernelBuild.bind) at the
    shape's first launch."""
    kernel: KernelBuild
    call: dict  # template, grid, threadgroup, output_shapes, output_dtypes
    consts: list  # [meta, scale]
    reduce: Optional[KernelBuild]  # the merge kernel (split rows), or None
    reduce_call: dict
    bound: list  # once bound: the kernel's launcher and keywords, then the merge's (_bind)


_launches: dict = {}


MMA_ROWS = 16  # query slots of the tensor-core kernel's block (mma.m16n8k16's rows)


def mma_warps(head_dim: int) -> int:
    """Warps of a tensor-core block: 4, or 2 where 4 warps' V tiles and merge buffers (16 slots) pass 44 KiB.
    From the head size alone: decode and a window assign a row's tiles to the same warps (same bits)."""
    for nw in (4, 2):
        if nw * (16 * (head_dim + 8) * 2 + MMA_ROWS * (head_dim + 2) * 4) <= 44 * 1024:
            return nw
    return 1


def tensor_cores(dtype: mx.Dtype, store: mx.Dtype, head_dim: int, heads: int, page: int, chunk: int) -> bool:
    """Whether dense decode and windows run on the tensor cores: bf16/fp16 queries and pages alike, heads of
    a multiple of 16 elements, at most 16 query heads a KV head, 16-token tiles that never cross a page
    or a split. Decode and windows decide alike, so a verification pass has decode's numbers."""
    return (dtype == store and dtype in (mx.bfloat16, mx.float16) and head_dim % 16 == 0 and head_dim <= 256
            and heads <= MMA_ROWS and page % 16 == 0 and chunk % 16 == 0)


def quant_tensor_cores(dtype: mx.Dtype, store: mx.Dtype, head_dim: int, heads: int, page: int, chunk: int,
                       key_bits: int, value_bits: int, group_size: int) -> bool:
    """Whether q8 decode runs on the tensor cores (cuda_source.mma_quant_source): where dense decode would, with
    8-bit keys and values in groups of 32, 64 or 128 elements (whole words a lane, one group a column tile)."""
    return (tensor_cores(dtype, store, head_dim, heads, page, chunk) and key_bits == value_bits == 8
            and group_size in (32, 64, 128) and head_dim % group_size == 0)


def _launch_for(kind: str, B: int, Hq: int, D: int, L: int, dtype: mx.Dtype, g: _Geometry, new_kv: bool,
                launch: CudaLaunch) -> _Launch:
    heads = Hq // g.kv_heads
    mma = kind.startswith("mma")
    qc = min(L, MMA_ROWS // heads) if mma else 1  # a window's positions a block
    nqc = -(-L // qc)
    rep = heads * qc  # query slots a block
    window = [("NL", L), ("QC", qc), ("NQC", nqc)] if mma else []
    nw = mma_warps(D) if mma else (warps_for(D, rep, launch.warps or WARPS[kind]) or warps_for(D, rep))
    ns, chunk, unsplit = splits_for(g.max_tokens, launch.chunk, launch.unsplit)
    meta = _const((g.maxp, ns, chunk, unsplit), mx.int32)
    template = [("T", dtype), ("S", g.store_dtype), ("D", D), ("P", g.page), ("REP", rep), ("HKV", g.kv_heads),
                ("NW", nw), ("LPT", _lanes(D)), ("NE", NE), ("U", launch.unroll or UNROLL.get(kind, 1))]
    template += list(g.extra) + window
    blocks = B * g.kv_heads * nqc  # before splits
    call = dict(template=template, grid=(blocks * ns * 32 * nw, 1, 1), threadgroup=(32 * nw, 1, 1))
    consts = [meta, _const((float(g.scale),), mx.float32)]
    shape = (B, Hq, L, D) if L > 1 else (B, Hq, D)
    if ns == 1:
        return _Launch(_kernel(kind, False, new_kv), dict(call, output_shapes=[shape], output_dtypes=[dtype]), consts,
                       None, {}, [])
    n = blocks * ns * rep
    return _Launch(_kernel(kind, True, new_kv),
                   dict(call, output_shapes=[(n,), (n,), (n * D,)], output_dtypes=[mx.float32] * 3), consts,
                   _kernel("reduce_window" if window else "reduce", False),
                   dict(template=[("T", dtype), ("D", D), ("REP", rep), ("HKV", g.kv_heads),
                                  ("QL", int("quant" in kind))] + window,
                        grid=(blocks * 128, 1, 1), threadgroup=(128, 1, 1),
                        output_shapes=[shape], output_dtypes=[dtype]), [])


def _launch(kind: str, inputs: list, q: mx.array, g: _Geometry, launch: CudaLaunch,
            new_kv: Optional[tuple[mx.array, mx.array]]) -> mx.array:
    """Run one kernel kind over q (B, Hq, L, D) (L = 1 but for a window); inputs end with the rows'
    key counts, which the merge of split rows reads too."""
    B, Hq, L, D = q.shape
    key = (kind, B, Hq, D, L, q.dtype, g, new_kv is not None, launch.chunk, launch.unsplit, launch.unroll,
           launch.warps)
    run = _launches.get(key)
    if run is None:
        if len(_launches) > 256:
            _launches.clear()
        run = _launches[key] = _launch_for(kind, B, Hq, D, L, q.dtype, g, new_kv is not None, launch)
    args = [q if L > 1 else q.reshape(B, Hq, D)] + inputs + run.consts
    if new_kv is not None:
        args += [a.reshape(B, g.kv_heads, D).astype(g.store_dtype) for a in new_kv]
    if not run.bound:
        run.bound.extend(_bind(run.kernel, args, run.call))
    if run.reduce is None:
        (out,) = run.bound[0](inputs=args, **run.bound[1])
    else:
        pm, pl, pacc = run.bound[0](inputs=args, **run.bound[1])
        merge_in = [pm, pl, pacc, run.consts[0], inputs[-1]]
        if len(run.bound) == 2:
            run.bound.extend(_bind(run.reduce, merge_in, run.reduce_call))
        (out,) = run.bound[2](inputs=merge_in, **run.bound[3])
    return out.reshape(B, Hq, L, D)


def _bind(kernel: KernelBuild, inputs: list, call: dict) -> tuple:
    """(the variant's launcher, its launch keywords: `call` but the template the launcher holds)."""
    return (kernel.bind(inputs, call["template"], call["output_dtypes"]),
            {k: v for k, v in call.items() if k != "template"})


def paged_decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array,
                           scale: float, launch: CudaLaunch,
                           new_kv: Optional[tuple[mx.array, mx.array]] = None) -> mx.array:
    """q (B, Hq, 1, D); pools (pages, Hkv, P, D); table (B, maxp) int32; lengths (B,) int32
    (keys stored, the new token included) -> (B, Hq, 1, D). new_kv: this step's (keys, values),
    (B, Hkv, 1, D), which the kernel stores into each row's slot len - 1 (then not stored
    before the call)."""
    _, Hkv, P, D = k_pool.shape
    maxp = table.shape[1]
    g = _Geometry(k_pool.dtype, Hkv, P, maxp * P, maxp, scale, ())
    kind = "dense"
    if launch.tensor_cores and tensor_cores(q.dtype, k_pool.dtype, D, q.shape[1] // Hkv, P, launch.chunk):
        kind = "mma_decode_f16" if q.dtype == mx.float16 else "mma_decode_bf16"
    return _launch(kind, [k_pool, v_pool, table.astype(mx.int32), lengths.astype(mx.int32)], q, g, launch, new_kv)


def paged_decode_attention_quantized(q: mx.array, pages: QuantPages, tails: mx.array, table: mx.array,
                                     positions: mx.array, scale: float, launch: CudaLaunch,
                                     new_kv: Optional[tuple[mx.array, mx.array]] = None) -> mx.array:
    """q (B, Hq, 1, D); tails (B,) the rows' tail slots; table (B, maxp) the rows' pages; positions (B,) int32:
    each row's new token's position p (the row's keys: p + 1; on sealed pages: p - p % P, the rest in its tail)
    -> (B, Hq, 1, D). new_kv as in paged_decode_attention (stored into the tail pages)."""
    _, Hkv, P, _ = pages.tail_k.shape
    maxp = table.shape[1]
    g = _Geometry(pages.tail_k.dtype, Hkv, P, maxp * P + P, maxp, scale,
                  (("KBITS", pages.key_bits), ("VBITS", pages.value_bits or pages.key_bits),
                   ("GS", pages.group_size)))
    inputs = [*pages.packed, pages.tail_k, pages.tail_v, tails.astype(mx.int32), table.astype(mx.int32),
              positions.astype(mx.int32)]
    kind = "quant"
    if launch.quant_tensor_cores and quant_tensor_cores(q.dtype, pages.tail_k.dtype, pages.tail_k.shape[-1],
                                                  q.shape[1] // Hkv, P, launch.chunk, pages.key_bits,
                                                  pages.value_bits or pages.key_bits, pages.group_size):
        kind = "mma_quant_f16" if q.dtype == mx.float16 else "mma_quant_bf16"
    return _launch(kind, inputs, q, g, launch, new_kv)


def paged_window_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, firsts: mx.array,
                           lengths: mx.array, scale: float, launch: CudaLaunch) -> mx.array:
    """A verification window: q (B, Hq, L, D), row b's L queries at its positions firsts[b]..;
    pools (pages, Hkv, P, D) with the window's keys already stored; table (B, maxp) int32; firsts
    (B,) keys before the window; lengths (B,) keys stored, the window's real tokens included ->
    (B, Hq, L, D). Query j sees min(firsts[b] + j + 1, lengths[b]) keys (a padding position: all of
    them). On the tensor cores where `tensor_cores` allows, as decode then runs (each row's pages read
    once for up to 16 query slots); else the decode kernel with each (row, position) as one of its
    rows (pages read once per position). Either way a position gets the numbers a decode step at its
    length would give it."""
    _, Hkv, P, D = k_pool.shape
    B, Hq, L, _ = q.shape
    maxp = table.shape[1]
    g = _Geometry(k_pool.dtype, Hkv, P, maxp * P, maxp, scale, ())
    if launch.tensor_cores and tensor_cores(q.dtype, k_pool.dtype, D, Hq // Hkv, P, launch.chunk):
        return _launch("mma_window_f16" if q.dtype == mx.float16 else "mma_window_bf16",
                       [k_pool, v_pool, table.astype(mx.int32), firsts.astype(mx.int32), lengths.astype(mx.int32)],
                       q, g, launch, None)
    seen = mx.minimum(firsts[:, None] + mx.arange(1, L + 1, dtype=mx.int32), lengths[:, None]).reshape(-1)
    one = q.transpose(0, 2, 1, 3).reshape(B * L, Hq, 1, D)
    out = paged_decode_attention(one, k_pool, v_pool, mx.repeat(table, L, axis=0), seen, scale, launch)
    return out.reshape(B, L, Hq, D).transpose(0, 2, 1, 3)


def seal_tail_pages(out: mx.array, pages: QuantPages, tails: mx.array, table: mx.array,
                    positions: mx.array) -> mx.array:
    """Quantize the q8/q4 tail pages `tails` (int32, B) of the rows whose tail fills at their position
    (`positions`, B: p % P == P - 1) into the row's page at that position (`table`, (B, maxp): table[b, p // P]),
    keys stored per token, in place; returns `out` (the layer's attention output) passed through, so the seal
    runs after the decode kernel that stored the pages' last tokens (cuda_source.SEAL). Bits as mx.quantize
    gives."""
    _, Hkv, P, D = pages.tail_k.shape
    n, gs = tails.shape[0], pages.group_size
    threads = max(2 * n * Hkv * P * (D // gs), -(-out.size // 8))
    template = (("T", pages.tail_k.dtype), ("HKV", Hkv), ("P", P), ("D", D), ("GS", gs), ("KBITS", pages.key_bits),
                ("VBITS", pages.value_bits or pages.key_bits))
    inputs = [out, *pages.packed, pages.tail_k, pages.tail_v, tails, table, positions,
              _const((out.size, n, table.shape[1]), mx.int32)]
    seal = _seals.get(template)  # the template fixes every input's dtype (the output's is the tails')
    if seal is None:
        seal = _seals[template] = _kernel("seal", False).bind(inputs, list(template), [out.dtype])
    (o,) = seal(inputs=inputs, grid=(-(-threads // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                output_shapes=[out.shape], output_dtypes=[out.dtype])
    return o


_seals: dict[tuple, Callable[..., list[mx.array]]] = {}  # the seal's launcher by template (a decode step's every layer)
