"""The one place an attention route is chosen: from the KV layout, the backend and the options.

                     kv none                            q8 / q4 / k8v4
  MLX CUDA           CudaDenseRoute (fused kernel)      CudaQuantRoute (fused kernel)
  CPU                DenseRoute, grouped decode,        QuantRoute, keys per channel when the
                     float32 pages read in place        page holds whole groups, packed pages
                                                        read in place (float32 stores)
  portable / Metal   PortableDenseRoute: decode reads   PortableQuantRoute: decode reads
                     pages in place (gather_mm),        packed pages in place (gather_qmm);
                     prefill gather + SDPA              prefill as QuantRoute

`options.route="portable"` takes the last row on any backend: what Apple's Metal backend runs,
so the CPU tests exercise it. The fused kernels also need a geometry they handle
(cuda_kernels.supports); elsewhere the portable route runs.
"""
from __future__ import annotations

import os

import mlx.core as mx

from kvbatch.engine.backend import backend
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.kv.store import DenseStore, QuantizedStore
from kvbatch.engine.memory import KVLayout
from kvbatch.engine.kv.routes import cuda_kernels
from kvbatch.engine.kv.routes.base import Geometry, Route
from kvbatch.engine.kv.routes.cuda import CudaDenseRoute, CudaQuantRoute
from kvbatch.engine.kv.routes.cpu_streams import cpu_streams
from kvbatch.engine.kv.routes.dense import IN_PLACE_MIN_PAGE, DenseRoute
from kvbatch.engine.kv.routes.portable import PortableDenseRoute, PortableQuantRoute
from kvbatch.engine.kv.routes.quant import QuantRoute


def cpu_route(options: EngineOptions) -> bool:
    """The CPU's own route (grouped decode, in-place reads, per-channel keys, one RoPE table a step):
    on the CPU backend, unless the options ask for the portable route."""
    return options.route == "auto" and backend().on_cpu


def fused_kernels(head_dim: int, rep: int, bits: tuple | None, group_size: int, options: EngineOptions) -> bool:
    """Whether decode runs the fused CUDA kernels for this geometry (rep: query heads per KV head;
    bits: (key bits, value bits), None or (None, None) for dense)."""
    quantized = bits is not None and bits[0] is not None
    return (options.route == "auto" and backend().cuda_kernels
            and cuda_kernels.supports(head_dim, rep, bits if quantized else None, group_size if quantized else None))


def k_quant_axis(layout: KVLayout, options: EngineOptions) -> str:
    """How quantized K pages are grouped: "channel" (along each page's tokens) on the CPU route when
    the page holds whole groups; else "token" (along head_dim; what the CUDA kernel and Metal read)."""
    return "channel" if cpu_route(options) and layout.page_size % layout.group_size == 0 else "token"


def select_route(layout: KVLayout, num_layers: int, dtype: mx.Dtype, tail_slots: int, upcast: bool,
                 query_heads: int, options: EngineOptions) -> tuple[DenseStore | QuantizedStore, Route]:
    """The cache's store and the route that reads and writes it."""
    geom = Geometry(layout.page_size, layout.num_kv_heads, layout.head_dim, query_heads)
    cpu = cpu_route(options)
    bits = (layout.key_bits, layout.value_bits)
    fused = fused_kernels(layout.head_dim, max(query_heads // layout.num_kv_heads, 1), bits,
                          layout.group_size, options)
    # CPU decode over float32 pages of IN_PLACE_MIN_PAGE+ tokens reads them where they lie
    cpu_pages = cpu and dtype == mx.float32 and layout.page_size >= IN_PLACE_MIN_PAGE
    if layout.quantized:
        assert layout.key_bits is not None and layout.value_bits is not None  # quantized: both set
        store = QuantizedStore(num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, dtype,
                               (layout.key_bits, layout.value_bits), layout.group_size, tail_slots,
                               k_axis=k_quant_axis(layout, options),
                               full_precision=layout.full_precision_tokens)
        if fused:
            if layout.full_precision_tokens:  # engine/gate.py refuses it first, in one line
                raise ValueError("kv.full_precision_tokens is not built in the fused CUDA kernel")
            return store, CudaQuantRoute(store, geom, options.cuda, options.step_reuse, upcast)
        if not cpu:
            return store, PortableQuantRoute(store, geom, options.multi_query, upcast)
        return store, QuantRoute(store, geom, _streams(cpu, options), in_place=cpu_pages and options.q_in_place,
                                 multi_query=options.multi_query)
    store = DenseStore(num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, dtype)
    if fused:
        return store, CudaDenseRoute(store, geom, upcast, options.cuda, options.step_reuse, options.multi_query)
    if not cpu:
        return store, PortableDenseRoute(store, geom, upcast, options.multi_query)
    return store, DenseRoute(store, geom, upcast, cpu=cpu, in_place=cpu_pages and not upcast and options.in_place,
                             streams=_streams(cpu, options), multi_query=options.multi_query)


def _streams(cpu: bool, options: EngineOptions) -> list:
    """The CPU streams decode attention spreads over (engine.options.attention_threads)."""
    return cpu_streams((options.attention_threads or min(os.cpu_count() or 1, 4)) if cpu else 1)
