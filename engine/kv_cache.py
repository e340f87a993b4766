"""The KV-cache manager: page tables, reservations, growth, and the per-layer views
that mlx-lm model code talks to (`offset`, `update_and_fetch`, `make_mask`).

One forward pass = `begin(rows, L)` (checks every row reserved room for L tokens,
builds slot maps and masks once for all layers) → the model runs, each layer
writing and attending through its view → `end()` advances the rows' lengths.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from kvbatch.engine import attention as att
from kvbatch.engine import cuda_attention, step_plan
from kvbatch.engine.errors import INSUFFICIENT_MEMORY, RowError, UnreservedWriteError
from kvbatch.engine.kv_store import DenseStore, QuantizedStore, dequantize
from kvbatch.engine.memory import KVLayout, available_memory
from kvbatch.engine.sizes import fmt_bytes
from kvbatch.engine.pages import PagePool


@dataclass
class CacheRow:
    """A row's claim on the cache: its page table, stored and reserved lengths."""

    key: str
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens stored
    reserved: int = 0  # tokens with a slot reserved (length <= reserved)
    tail: Optional[int] = None  # quantized modes: its dense tail-page slot
    peak_pages: int = 0


@dataclass
class _Plan:
    rows: list[CacheRow]
    L: int
    offset: object
    poison: Optional[mx.array] = None
    tensors: dict = field(default_factory=dict)


class PagedLayerCache:
    """What one mlx-lm attention layer sees. Attention itself is routed via `paged_attend`."""

    def __init__(self, mgr: "PagedKVCache", layer: int):
        self.mgr, self.layer = mgr, layer

    @property
    def offset(self):
        return self.mgr.plan.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.mgr.write(self.layer, keys, values)
        return keys, values  # attention reads the pages, not these

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the paged cache")
        return None  # the paged attention builds its own padding+causal masks

    def paged_attend(self, queries: mx.array, scale: float) -> mx.array:
        return self.mgr.attend(self.layer, queries, scale)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.mgr.store.layer_arrays(self.layer))

    def __repr__(self) -> str:
        return f"PagedLayerCache(layer={self.layer}, mode={self.mgr.layout.mode}, page_size={self.mgr.P})"


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_layers: int, dtype: mx.Dtype, tail_slots: int,
                 upcast: bool, trace: str = "", query_heads: int = 0):
        self.layout, self.P = layout, layout.page_size
        self.num_layers = num_layers
        if layout.bits:
            self.store = QuantizedStore(num_layers, layout.num_kv_heads, layout.head_dim, self.P, dtype,
                                        layout.bits, layout.group_size, tail_slots,
                                        k_axis=k_quant_axis(layout))
            self.route = att.ROUTE_QMM
            self.qmm_streams = att.qmm_streams()
        else:
            self.store = DenseStore(num_layers, layout.num_kv_heads, layout.head_dim, self.P, dtype)
            self.route = att.ROUTE_DENSE_F32 if upcast else att.ROUTE_DENSE
        self.fused_decode = cuda_attention.usable(layout, self.store, query_heads)
        self.kernel_writes = self.fused_decode and cuda_attention.kernel_writes()  # CUDA decode stores
        self.cuda_tuning = cuda_attention.tuning() if self.fused_decode else None
        if self.fused_decode:
            self.route = att.ROUTE_CUDA_Q if layout.bits else att.ROUTE_CUDA
        self.upcast = upcast
        # CPU decode over float32 pages of IN_PLACE_MIN_PAGE+ tokens reads them in place: dense pages
        # through attention.paged_grouped_decode (KVBATCH_IN_PLACE=0: gather), packed q8/q4 pages
        # through attention.quantized_paged_decode (KVBATCH_Q_IN_PLACE=0: attention.quantized_decode_attention)
        cpu_pages = (not self.fused_decode and dtype == mx.float32 and self.P >= att.IN_PLACE_MIN_PAGE
                     and att.on_cpu())
        self.in_place = (cpu_pages and not layout.bits and not upcast
                         and os.environ.get("KVBATCH_IN_PLACE", "1") != "0")
        self.q_in_place = cpu_pages and bool(layout.bits) and os.environ.get("KVBATCH_Q_IN_PLACE", "1") != "0"
        self.pool = PagePool()
        self.free_tails = list(range(tail_slots))[::-1]
        self.views = [PagedLayerCache(self, i) for i in range(num_layers)]
        self.plan: Optional[_Plan] = None
        self.growth_events: list[dict] = []
        self.peak_capacity_pages = 0
        self.trace = trace
        self._reported: set = set()
        self._segment: dict[int, tuple[mx.array, mx.array]] = {}
        self._new_kv: dict[int, tuple[mx.array, mx.array]] = {}  # decode K/V the fused kernel stores
        # bumped whenever a row gains or loses pages or a tail: the CUDA decode reuses the last
        # step's page tables only within one epoch (step_plan.reused; KVBATCH_STEP_REUSE=0: never)
        self.epoch = 0
        self.last_decode: Optional[tuple] = None
        self.reuse_steps = os.environ.get("KVBATCH_STEP_REUSE", "1") != "0"

    # ---- capacity (always from the live buffers) -------------------------------------------
    @property
    def capacity_pages(self) -> int:
        return self.store.capacity_pages

    @property
    def capacity_bytes(self) -> int:
        return self.store.nbytes

    # ---- reservation -----------------------------------------------------------------------
    def admit(self, row: CacheRow) -> None:
        self.epoch += 1
        if self.store.quantized:
            if not self.free_tails:
                raise RuntimeError("no free tail page: more rows admitted than tail slots")
            row.tail = self.free_tails.pop()

    def reserve(self, row: CacheRow, n_tokens: int, kv_limit_bytes: int, want_pages: int = 0) -> None:
        """Make room for the next n_tokens of row, growing the pool if needed (priced first).

        want_pages: the most pages the running rows can ever hold together (their worst
        cases); a geometric growth stops there instead of doubling past it."""
        need_tokens = row.length + n_tokens
        need_pages = -(-need_tokens // self.P) - len(row.pages)
        if need_pages > 0:
            self.epoch += 1
            if need_pages > self.pool.num_free:
                self._grow(self.pool.in_use + need_pages, kv_limit_bytes, want_pages)
            row.pages += self.pool.allocate(need_pages)
            row.peak_pages = max(row.peak_pages, len(row.pages))
        row.reserved = max(row.reserved, need_tokens)

    def release(self, row: CacheRow, scrub: bool = False) -> None:
        """Give the row's pages (and tail) back. scrub: zero them first (a row that ended in
        error may hold NaN/inf K/V; the next owner's masked slots must not carry it)."""
        self.epoch += 1
        if scrub:
            if row.pages:
                self.store.clear_pages(row.pages)
            if row.tail is not None:
                self.store.clear_tail(row.tail)
        self.pool.free(row.pages)
        row.pages = []
        row.reserved = row.length = 0
        if row.tail is not None:
            self.free_tails.append(row.tail)
            row.tail = None

    def _grow(self, needed_pages: int, kv_limit_bytes: int, want_pages: int = 0) -> None:
        cap, pb = self.capacity_pages, self.layout.page_bytes
        # MLX's cached buffers are memory it can hand back: they count as free, and are only
        # cleared when the growth needs them (clearing them every time costs the next steps
        # fresh pages from the OS: page faults on every temporary).
        free_os = available_memory()
        free_now = free_os + mlx_cached_memory()
        # Geometric first (capped at the running rows' worst case, which is all the pool can
        # ever need for them); if the budget cannot take that, the largest pool it can take
        # (not one page at a time: every growth copies the pool); then exactly what is needed.
        double = min(2 * cap, want_pages) if want_pages else 2 * cap
        budget_max = kv_limit_bytes * self.num_layers // ((self.num_layers + 1) * pb)
        for target in (max(needed_pages, double), max(needed_pages, min(double, budget_max)), needed_pages):
            transient = -(-target * pb // self.num_layers)  # one layer's new buffer coexists with the old
            if target * pb + transient <= kv_limit_bytes and (target - cap) * pb + transient <= free_now:
                if (target - cap) * pb + transient > free_os:
                    mx.clear_cache()
                t0 = time.perf_counter()
                self.store.grow(target)
                self.pool.add_pages(self.capacity_pages)
                self.peak_capacity_pages = max(self.peak_capacity_pages, self.capacity_pages)
                self.growth_events.append({"from_pages": cap, "to_pages": self.capacity_pages,
                                           "bytes": self.capacity_bytes, "seconds": time.perf_counter() - t0})
                return
        raise RowError(INSUFFICIENT_MEMORY,
                       f"KV pool growth to {needed_pages} pages ({fmt_bytes(needed_pages * pb)}) refused: "
                       f"KV budget {fmt_bytes(kv_limit_bytes)}, machine free {fmt_bytes(free_now)}")

    # ---- one forward pass ------------------------------------------------------------------
    def begin(self, rows: list[CacheRow], L: int, poison: Optional[list[bool]] = None) -> None:
        if self.pool.capacity > self.capacity_pages:  # every page id the pool hands out is in the buffers
            raise UnreservedWriteError(f"the page pool ({self.pool.capacity} pages) exceeds the live buffers "
                                       f"({self.capacity_pages})")
        P, pos = self.P, []
        for r in rows:
            if r.length + L > r.reserved:
                raise UnreservedWriteError(
                    f"row {r.key}: forward of {L} tokens at {r.length} but only {r.reserved} reserved")
            if r.reserved > len(r.pages) * P:
                raise UnreservedWriteError(f"row {r.key}: {r.reserved} tokens reserved in {len(r.pages)} pages")
            pos.append(r.length)
        offset = pos[0] if len(rows) == 1 else mx.array(pos, dtype=mx.int32)
        self.plan = _Plan(rows, L, offset)
        if poison is not None and any(poison):
            self.plan.poison = mx.array(poison)
        if self.store.quantized and L == 1 and self.fused_decode:
            self.plan.tensors = step_plan.quantized_fused_decode(self, rows, pos)
        elif self.store.quantized:
            self.plan.tensors = step_plan.quantized(self, rows, L, np.array(pos, dtype=np.int32))
        elif L == 1:
            self.plan.tensors = step_plan.decode(self, rows, pos)
        else:
            self.plan.tensors = step_plan.dense(self, rows, L, np.array(pos, dtype=np.int32))
        self._reported = set()
        self._new_kv.clear()

    def end(self) -> None:
        for r in self.plan.rows:
            r.length += self.plan.L
        self.plan = None

    # ---- called by the model, layer by layer -----------------------------------------------
    def write(self, layer: int, keys: mx.array, values: mx.array) -> None:
        plan = self.plan
        if plan is None:
            raise UnreservedWriteError("KV write outside a reserved forward pass")
        B, H, L, D = keys.shape
        if B != len(plan.rows) or L != plan.L:
            raise UnreservedWriteError(f"KV write of {B}x{L} tokens into a pass reserved for "
                                       f"{len(plan.rows)}x{plan.L}")
        t = plan.tensors
        if "kernel_writes" in t:  # stored by the fused decode kernel (attend)
            self._new_kv[layer] = (keys, values)
            return
        if L == 1:  # (B, H, 1, D) is (B, H, D) already: no transposed copy
            k, v = keys.reshape(B, H, D), values.reshape(B, H, D)
        else:
            k = keys.transpose(0, 2, 1, 3).reshape(B * L, H, D)
            v = values.transpose(0, 2, 1, 3).reshape(B * L, H, D)
        if not self.store.quantized:
            self.store.write(layer, t["rows"], k, v)
        elif "run" in t:
            tail, fill, slots = t["run"]
            self._segment[layer] = self.store.write_run(layer, tail, fill, slots, k, v)
        else:
            self.store.write_tokens(layer, t["tail_write"], k, v)
            if "seal_pages" in t:
                self.store.seal_tail_pages(layer, *t["seal_pages"])
            elif "seal_from" in t:
                self.store.seal_tails(layer, t["seal_from"], t["seal_to"])

    def attend(self, layer: int, queries: mx.array, scale: float) -> mx.array:
        plan, t, st = self.plan, self.plan.tensors, self.store
        if "lengths" in t:  # CUDA: pages read in place by the fused decode kernel
            out = cuda_attention.paged_decode_attention(queries, st.k[layer], st.v[layer], t["table"],
                                                        t["lengths"], scale, new_kv=self._new_kv.pop(layer, None),
                                                        tune=self.cuda_tuning)
        elif "lens" in t:
            out = cuda_attention.paged_decode_attention_quantized(
                queries, st.q[layer], st.tk[layer], st.tv[layer], t["tails"], t["table_q"], t["lens"], scale,
                st.bits, st.group_size, new_kv=self._new_kv.pop(layer, None), tune=self.cuda_tuning)
        elif "page_heads" in t:
            out = att.paged_grouped_decode(queries, st.k[layer], st.v[layer], t["page_heads"], t["query_of"],
                                           t["mask"], scale)
        elif "q_page_heads" in t:  # CPU q8/q4 decode: packed pages read in place
            tk, tv = st.gather_tails(layer, t["tails"])
            q = st.q[layer]
            out = att.quantized_paged_decode(queries, q[:3], q[3:], tk, tv, t["q_page_heads"], t["query_of"],
                                             t["mask_p"], scale, st.group_size, st.bits, self.qmm_streams,
                                             t["cuts"], k_transposed=st.k_axis == "channel")
        elif not st.quantized:
            k, v = st.gather(layer, t["table"])
            out = att.dense_attention(queries, k, v, t["mask"], scale, self.upcast)
        elif "run" in t:  # prefill: sealed pages dequantized once for the chunk, the rest as written
            sk, sv = (a.transpose(1, 0, 2)[None] for a in self._segment.pop(layer))
            if "table_q" in t:
                qk = st.gather_quantized(layer, t["table_q"])
                sk = mx.concatenate([st.dequantize_k(*qk[:3]), sk], axis=2)
                sv = mx.concatenate([dequantize(*qk[3:], st.group_size, st.bits), sv], axis=2)
            out = att.dense_attention(queries, sk, sv, t["mask"], scale, upcast=True)
        else:
            tk, tv = st.gather_tails(layer, t["tails"])
            qk = qv = mask_q = None
            if "table_q" in t:
                qk = []
                for i, run in enumerate(t["runs_q"]):  # each run's gather on the stream that uses it
                    if self.qmm_streams[i] is None:
                        qk.append(st.gather_quantized(layer, run, "k"))
                    else:
                        with mx.stream(self.qmm_streams[i]):
                            qk.append(st.gather_quantized(layer, run, "k"))
                qv, mask_q = st.gather_quantized(layer, t["table_q"], "v"), t["mask_q"]
            out = att.quantized_decode_attention(queries, qk, qv, tk, tv, mask_q, t["mask_t"], scale,
                                                 st.group_size, st.bits, self.qmm_streams,
                                                 k_transposed=st.k_axis == "channel", mask=t["mask_all"])
        if plan.poison is not None and layer == 0:  # testing-only fault injection
            out = mx.where(plan.poison[:, None, None, None], mx.array(mx.nan, out.dtype), out)
        if self.trace:
            self._trace(layer, out)
        return out

    def _trace(self, layer: int, out: mx.array) -> None:
        plan = self.plan
        bad = (~mx.isfinite(out)).sum(axis=(1, 2, 3)).tolist()
        for r, n_bad in zip(plan.rows, bad):
            if self.trace == "nonfinite" and (not n_bad or r.key in self._reported):
                continue
            self._reported.add(r.key)
            print(f"[kvbatch attention] layer={layer} cache={self.views[layer]!r} route={self.route} "
                  f"row={r.key} offset={r.length} L={plan.L} capacity={self.capacity_pages * self.P} "
                  f"reserved={r.reserved} nonfinite={n_bad}", file=sys.stderr, flush=True)


def k_quant_axis(layout: KVLayout) -> str:
    """How quantized K pages are grouped: "channel" (along each page's tokens) on the CPU
    when the page holds whole groups; else "token" (along head_dim; what the CUDA kernel
    reads). See QuantizedStore."""
    return "channel" if att.on_cpu() and layout.page_size % layout.group_size == 0 else "token"


def mlx_cached_memory() -> int:
    """Bytes of freed buffers MLX keeps for reuse (reclaimable by mx.clear_cache())."""
    return int(mx.get_cache_memory())


def trace_mode() -> str:
    """KVBATCH_ATTENTION_TRACE: '' (off), 'nonfinite', or '1' (every call)."""
    v = os.environ.get("KVBATCH_ATTENTION_TRACE", "").strip().lower()
    return "" if v in ("", "0", "off", "false") else ("nonfinite" if v == "nonfinite" else "1")
