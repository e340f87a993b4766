"""MLX CUDA: decode through the fused paged kernels (routes/cuda_kernels.py); prefill as the
portable dense / quantized routes, with attention composed of matmuls (dense.composed_attention:
no cuDNN graph per pass shape).

A decode step's arrays come from host lists; in the H200's decode loop each such array costs the
host 0.1-0.15 ms, and over 1 ms where MLX hands it a freed device buffer (docs/performance.md). So
a step builds few (`options.step_reuse`): while the same rows decode, one token on, their positions
advance on the device with one add and their tail slots stay (`StepArrays`); the page table is the
previous step's while no row's page count moved (`PageTables`); lengths are derived on the device from the
positions, and the q8/q4 kernels read the positions themselves (a row's sealed and tail counts, and the page
its full tail seals into).

A dense pass of a few tokens a row (a speculative verification window: the row's token and its
k proposals) is attention of several queries per row over the row's pages, each query seeing the
keys up to its own position (`CudaMulti`): cuda_kernels.paged_window_attention computes it over
the pages in place, on the tensor cores for bf16/fp16 (each row's pages read once for all its
window's queries), else with the decode kernel once per position. Its K/V are scattered into the
pages first, as a prefill chunk's are. So verification reads the pages in place like decode instead
of gathering every row's pages into a contiguous copy and composing matmuls over it
(`EngineOptions.multi_query`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from kvbatch.engine.config import CudaLaunch
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.routes.base import Geometry, flat_tokens
from kvbatch.engine.kv.routes.common import TailWrites, page_table, tail_writes
from kvbatch.engine.kv.routes.cuda_kernels import (QuantPages, paged_decode_attention, paged_decode_attention_quantized,
                                                   paged_window_attention, seal_tail_pages)
from kvbatch.engine.kv.routes.dense import DenseRoute, DenseStep
from kvbatch.engine.kv.routes.quant import QuantRoute
from kvbatch.engine.kv.store import head_rows

ROUTE_CUDA = "paged_cuda_kernel"
ROUTE_CUDA_Q = "paged_cuda_qkernel"

_ONE = mx.array(1, dtype=mx.int32)


class StepArrays:
    """A decode step's per-row device arrays, carried from the step before (see the module docstring):
    the rows' positions (int32, B) and, for a quantized cache, their tail slots. Carried while the same
    rows (the same admissions: a row admitted again may hold another tail) decode in the same order:
    positions one token on (the step before's + 1) or the same (a step built and dropped). Else
    built from the host's lists. enabled=False (engine.options.step_reuse): built every step."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._key: Optional[tuple] = None
        self._pos: list[int] = []
        self._arrays: tuple[mx.array, Optional[mx.array]] = (_ONE, None)

    def get(self, rows: list[CacheRow], pos: list[int], tails: bool) -> tuple[mx.array, Optional[mx.array]]:
        """(positions, tail slots or None) of `rows` at positions `pos`."""
        key = (tuple(map(id, rows)), tuple(r.admissions for r in rows), tails)
        p, t = self._arrays
        if not (self.enabled and key == self._key and (pos == self._pos or pos == [a + 1 for a in self._pos])):
            p, t = mx.array(pos, dtype=mx.int32), (mx.array([r.tail_slot for r in rows], dtype=mx.int32)
                                                   if tails else None)
        elif pos != self._pos:
            p = p + _ONE
        self._key, self._pos, self._arrays = key, pos, (p, t)
        return p, t


@dataclass(frozen=True)
class CudaDecode:
    """A CUDA dense decode step's metadata: page table and key counts the fused kernel reads."""

    table: mx.array
    lengths: mx.array  # (B,) keys stored, the new token included
    rows: Optional[mx.array] = None  # head rows of the new token, when it is scattered before the kernel
    positions: Optional[mx.array] = None  # (B,) the rows' positions, where StepArrays carries them


@dataclass(frozen=True)
class CudaMulti:
    """A few-token dense pass read in place (paged_window_attention): the pass's writes (as a prefill
    chunk's), and per row its keys before the window and its keys with the window's real tokens."""

    step: DenseStep  # head rows of the real tokens, which of the padded pass's tokens are real, page table
    firsts: mx.array  # (B,) pos[b]: query j sees pos[b] + j + 1 keys
    lengths: mx.array  # (B,) pos[b] + lens[b] (what a padding position sees)


class CudaDenseRoute(DenseRoute):
    """kv none on MLX CUDA: decode by the fused paged kernel, prefill as the dense route with composed attention."""

    def __init__(self, store, geom: Geometry, upcast: bool, launch: CudaLaunch, step_reuse: bool,
                 multi_query: int = 1):
        super().__init__(store, geom, upcast, cpu=False, in_place=False, multi_query=multi_query)
        self.name, self.launch, self.steps = ROUTE_CUDA, launch, StepArrays(step_reuse)  # not DenseRoute's name
        self.composed = True  # prefill: no cuDNN graph per pass shape (dense.composed_attention)
        self._new_kv: dict[int, tuple[mx.array, mx.array]] = {}  # decode K/V the kernel stores

    def plan(self, rows, L, pos, lens):
        """Decode: a page table and lengths for the kernel (see the module docstring); prefill: the dense route's
        plan."""
        if L > self.multi_query:
            return self.prefill_plan(rows, L, pos, lens)
        if L > 1:
            step = self.prefill_plan(rows, L, pos, lens, mask=False)
            return CudaMulti(step, mx.array(pos, dtype=mx.int32),
                             mx.array([a + n for a, n in zip(pos, lens)], dtype=mx.int32))
        P = self.geom.page_size
        n_pages = [a // P + 1 for a in pos]
        if self.launch.kernel_writes:  # the kernel stores the token (slot len - 1)
            p, _ = self.steps.get(rows, pos, tails=False)
            return CudaDecode(self.tables.table(rows, n_pages, self.steps.enabled), p + _ONE, positions=p)
        table = page_table(rows, n_pages)
        slots = [r.pages[a // P] * P + a % P for r, a in zip(rows, pos)]
        hrows = mx.array(head_rows(slots, P, self.geom.kv_heads), dtype=mx.int32)
        return CudaDecode(table, mx.array([a + 1 for a in pos], dtype=mx.int32), hrows)

    def chained_plan(self, rows, L, pos, n_pages):
        """A chained window (Route.chained_plan) read in place by paged_window_attention, as `plan` reads a window."""
        if L > self.multi_query:
            return super().chained_plan(rows, L, pos, n_pages)
        table, hrows = self.chained_writes(rows, L, pos, n_pages)
        return CudaMulti(DenseStep(hrows, table), pos, pos + L)

    def write(self, layer: int, meta: object, keys: mx.array, values: mx.array) -> None:
        """Decode: keep the new K/V for the kernel to store (or scatter them first); prefill: as the dense route."""
        if isinstance(meta, CudaMulti):
            return super().write(layer, meta.step, keys, values)
        if isinstance(meta, DenseStep):
            return super().write(layer, meta, keys, values)
        assert isinstance(meta, CudaDecode)
        if meta.rows is None:
            self._new_kv[layer] = (keys, values)  # stored by the kernel (attend)
            return
        k, v = flat_tokens(keys, values)
        self.store.write(layer, meta.rows, k, v)

    def attend(self, layer: int, meta: object, queries: mx.array, scale: float) -> mx.array:
        """Decode: the fused paged kernel over the rows' pages; prefill: the dense route's attention."""
        st = self.store
        if isinstance(meta, CudaMulti):
            return paged_window_attention(queries, st.k[layer], st.v[layer], meta.step.table, meta.firsts,
                                          meta.lengths, scale, self.launch)
        if isinstance(meta, DenseStep):
            return super().attend(layer, meta, queries, scale)
        assert isinstance(meta, CudaDecode)
        return paged_decode_attention(queries, st.k[layer], st.v[layer], meta.table, meta.lengths, scale,
                                      self.launch, new_kv=self._new_kv.pop(layer, None))

    def end(self):
        """Drop the decode K/V held for the kernel at the end of the pass."""
        self._new_kv.clear()


@dataclass(frozen=True)
class CudaQuantDecode:
    """A CUDA quantized decode step's metadata: the tails, page table and positions the fused kernels read."""

    tails: mx.array
    table_q: mx.array  # (B, n) each row's pages up to the one its tail seals into (the kernel reads the sealed ones)
    positions: mx.array  # (B,) the rows' positions (StepArrays): the kernels derive sealed and tail counts from them
    writes: Optional[TailWrites] = None  # None: the kernel stores the token in the tail
    seal: bool = False  # after the kernel, the rows whose tail fills this step seal it (cuda_kernels.seal_tail_pages)


class CudaQuantRoute(QuantRoute):
    """q8/q4/k8v4 on MLX CUDA: decode through the fused quantized paged kernel, prefill as the quantized route."""

    name = ROUTE_CUDA_Q

    def __init__(self, store, geom: Geometry, launch: CudaLaunch, step_reuse: bool, upcast: bool):
        super().__init__(store, geom, streams=[None], in_place=False, upcast=upcast)
        self.launch, self.steps = launch, StepArrays(step_reuse)
        self.composed = True
        self._new_kv: dict[int, tuple[mx.array, mx.array]] = {}

    def plan(self, rows, L, pos, lens):
        """Decode: one token per row into its tail; a row that fills its tail page seals it."""
        if L > 1:
            return super().plan(rows, L, pos, lens)
        P = self.geom.page_size
        p, tails = self.steps.get(rows, pos, tails=True)
        assert tails is not None  # asked for
        table = self.tables.table(rows, [a // P + 1 for a in pos], self.steps.enabled)
        fill = [a % P for a in pos]  # tokens in the tail before this one
        if self.launch.kernel_writes and P - 1 not in fill:
            return CudaQuantDecode(tails, table, p)
        if self.launch.kernel_writes and self.store.k_axis == "token":
            # With 256 rows at random lengths some row fills its tail at nearly every step: the kernel still
            # stores the tokens, and one launch a layer seals the filled tails, where TailWrites' scatters and
            # quantizations are ~12 launches a layer
            return CudaQuantDecode(tails, table, p, seal=True)
        return CudaQuantDecode(tails, table, p, writes=tail_writes(P, self.geom.kv_heads, self.store.k_axis, rows,
                                                                   pos, [r.tail_slot for r in rows], fill))

    def write(self, layer, meta, keys, values):
        """Decode: keep the new K/V for the kernel to store in the tails (or write them first); prefill: the quantized
        route's write."""
        if not isinstance(meta, CudaQuantDecode):
            return super().write(layer, meta, keys, values)
        if meta.writes is None:
            self._new_kv[layer] = (keys, values)
            return
        k, v = flat_tokens(keys, values)
        meta.writes.apply(self.store, layer, k, v)

    def attend(self, layer, meta, queries, scale):
        """Decode: the fused quantized kernel over sealed pages and tails; prefill: the quantized route's attention."""
        if not isinstance(meta, CudaQuantDecode):
            return super().attend(layer, meta, queries, scale)
        st = self.store
        pages = QuantPages(st.q[layer], st.tk[layer], st.tv[layer], st.key_bits, st.group_size, st.value_bits)
        out = paged_decode_attention_quantized(queries, pages, meta.tails, meta.table_q, meta.positions, scale,
                                               self.launch, new_kv=self._new_kv.pop(layer, None))
        return seal_tail_pages(out, pages, meta.tails, meta.table_q, meta.positions) if meta.seal else out

    def end(self):
        """Drop the pass's state, the decode K/V held for the kernel included."""
        super().end()
        self._new_kv.clear()
