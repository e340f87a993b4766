"""The KV-cache manager: admission, reservations, growth and release of pages, and one forward
pass at a time handed to its attention route.

One forward pass = `begin(rows, L)` (checks every row reserved room for L tokens, and has the
route build the pass's metadata once for all layers) → the model runs, each layer writing and
attending through its view (mlx_lm_bridge.PagedLayerCache) → `end()` advances the rows' lengths.
The route (engine/kv/routes/, chosen by routes/select.py) owns how pages are read and written.

Pages are reference-counted (kv/pages.py): a row may hold pages other rows hold too, cached full
pages of a prefix they share (`take_cached`, kv/prefix.py) or the prompt pages of the sample it
was forked from (`fork`). A row only ever writes into pages it alone holds: the page it is
filling is its own (copied on write at a fork), and `begin` refuses a pass that would write into
a shared or cached page.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, cast

import mlx.core as mx

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.errors import INSUFFICIENT_MEMORY, RowError, UnreservedWriteError
from kvbatch.engine.kv import offload
from kvbatch.engine.kv.pages import CacheRow, PagePool
from kvbatch.engine.kv.prefix import cache_full_pages, computed_pages
from kvbatch.engine.kv.rotation import KeyRotation
from kvbatch.engine.memory import KVLayout, available_memory
from kvbatch.engine.kv.store import QuantizedStore, head_rows
from kvbatch.engine.kv.routes.base import flat_tokens
from kvbatch.engine.kv.routes.select import select_route
from kvbatch.engine.sizes import fmt_bytes

# engine.options.attention_trace's lines: warnings, so they reach stderr under the command and, through
# Python's last-resort handler, where the caller configured no logging
trace_log = logging.getLogger("kvbatch.attention")


@dataclass
class _Pass:
    rows: list[CacheRow]
    L: int
    lens: list[int]  # real tokens per row (<= L)
    offset: object
    meta: object  # the route's metadata of this pass
    poison: Optional[mx.array] = None
    # kv.full_precision_tokens: the pass's tokens at positions < N (flat b * L + i) and the head rows
    # of their places in the rows' dense first-token copies (QuantizedStore.write_first)
    first: Optional[tuple[mx.array, mx.array]] = None


class PagedLayerCache:
    """What one mlx-lm attention layer sees. Attention itself is routed via `paged_attend`."""

    def __init__(self, mgr, layer: int):
        """mgr: the PagedKVCache that holds every layer."""
        self.mgr, self.layer = mgr, layer

    @property
    def offset(self):
        """Each row's position of the pass's first token (mlx-lm's cache protocol: the RoPE offset)."""
        return self.mgr.plan.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write this pass's K/V into the rows' pages (mlx-lm's cache protocol); attention reads the pages."""
        self.mgr.write(self.layer, keys, values)
        return keys, values  # attention reads the pages, not these

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """No mask for mlx-lm: the route builds the pass's padding and causal masks itself."""
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the paged cache")
        return None  # the paged attention builds its own padding+causal masks

    def paged_attend(self, queries: mx.array, scale: float) -> mx.array:
        """This layer's attention over the pages (called by the patched scaled_dot_product_attention)."""
        return self.mgr.attend(self.layer, queries, scale)

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's page arrays."""
        return sum(a.nbytes for a in self.mgr.store.layer_arrays(self.layer))

    def __repr__(self) -> str:
        return f"PagedLayerCache(layer={self.layer}, mode={self.mgr.layout.mode}, page_size={self.mgr.P})"


class PagedKVCache:
    """One engine's paged KV cache: page pool, stores and route, row reservations, and one forward pass at a time."""

    def __init__(self, layout: KVLayout, num_layers: int, dtype: mx.Dtype, tail_slots: int, upcast: bool,
                 query_heads: int = 0, options: Optional[EngineOptions] = None, prefix_cache: bool = False):
        options = options or EngineOptions()
        # kv.full_precision_tokens: each row's first N tokens also copied dense here, at the cache's edge
        # (after the rotation), for every route; the route reads them from the copy (routes/quant.py).
        # No prefix caching then: a cached page's first tokens would have no dense copy left.
        self.first = layout.full_precision_tokens if layout.quantized else 0
        self.prefix_cache = prefix_cache and not self.first
        self.layout, self.P = layout, layout.page_size
        self.num_layers = num_layers
        self.store, self.attention = select_route(layout, num_layers, dtype, tail_slots, upcast, query_heads, options)
        # kv.rotate_keys: keys stored, and queries attending, in one rotated basis (kv/rotation.py)
        self.rotation = KeyRotation(layout.head_dim) if layout.rotate_keys else None
        self.pool = PagePool()
        self.free_tails = list(range(tail_slots))[::-1]
        self.views = [PagedLayerCache(self, i) for i in range(num_layers)]
        self.plan: Optional[_Pass] = None
        self.growth_events: list[dict] = []
        self.peak_capacity_pages = 0
        self.trace = options.attention_trace if options.attention_trace != "off" else ""
        self._reported: set = set()

    @property
    def route(self) -> str:
        """The name of the attention route that runs (reported per row and in summary.json)."""
        return self.attention.name

    # ---- capacity (always from the live buffers) -------------------------------------------
    @property
    def capacity_pages(self) -> int:
        """Pages the pool holds now (it grows on demand up to the memory budget)."""
        return self.store.capacity_pages

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the pool's packed or dense pages at its current capacity."""
        return self.store.nbytes

    # ---- reservation -----------------------------------------------------------------------
    def admit(self, row: CacheRow) -> None:
        """Give a newly admitted row its claim on the cache (and, for quantized modes, a tail page)."""
        row.admissions += 1
        if self.store.quantized:
            if not self.free_tails:
                raise RuntimeError("no free tail page: more rows admitted than tail slots")
            row.tail = self.free_tails.pop()

    def hold(self, rows: list[CacheRow], n_tokens: Optional[list[int]] = None) -> list[int]:
        """Reserve each row's next n_tokens (one each where None) where its pages already hold them (no page to
        take, nothing to price); the indices of the rows whose tokens need a page (`reserve`). One call for a
        step's rows: a call per row costs a decode step ~0.1 ms at a thousand rows."""
        P, short = self.P, []
        for i, row in enumerate(rows):
            need = row.length + (n_tokens[i] if n_tokens is not None else 1)
            if need > len(row.pages) * P:
                short.append(i)
            elif need > row.reserved:
                row.reserved = need
        return short

    def reserve(self, row: CacheRow, n_tokens: int, kv_limit_bytes: int, want_pages: int = 0) -> None:
        """Make room for the next n_tokens of row, growing the pool if needed (priced first).

        want_pages: the most pages the running rows can ever hold together (their worst
        cases); a geometric growth stops there instead of doubling past it."""
        if not self.hold([row], [n_tokens]):
            return
        need_tokens = row.length + n_tokens
        need_pages = -(-need_tokens // self.P) - len(row.pages)
        if need_pages > self.pool.num_free:
            self._grow(self.pool.in_use + need_pages, kv_limit_bytes, want_pages)
        row.pages += self.pool.allocate(need_pages)
        row.peak_pages = max(row.peak_pages, len(row.pages))
        row.reserved = max(row.reserved, need_tokens)

    def release(self, row: CacheRow, scrub: bool = False, tokens: Optional[list[int]] = None) -> None:
        """Give the row's pages (and tail) back. tokens: its token sequence; with prefix caching its
        full pages of known tokens stay cached for later rows. scrub: zero the pages it alone held
        first (a row that ended in error may hold NaN/inf K/V; the next owner's masked slots must not
        carry it; pages others hold, or cached when its prompt gave finite logits, are left as they are)."""
        if scrub:
            own = [p for p in row.pages if self.pool.ref(p) == 1 and not self.pool.is_cached(p)]
            if own:
                self.store.clear_pages(own)
            if row.tail is not None:
                self._quantized_store().clear_tail(row.tail)
        elif tokens is not None:
            self.cache_pages(row, tokens, min(row.length, len(tokens)))
        self.pool.free(row.pages)
        row.pages = []
        row.reserved = row.length = 0
        if row.tail is not None:
            self.free_tails.append(row.tail)
            row.tail = None

    def rollback(self, row: CacheRow, length: int) -> None:
        """Cut the row back to its first `length` stored tokens (a verification's rejected tokens):
        its reservation ends there and the pages past it go back to the pool. Those pages hold only
        tokens written by the pass that is cut back, so this row alone holds them and none is cached
        (begin() checked); with quantized pages the pass sealed none of them (speculative/window.py)."""
        if length >= row.length:
            return
        row.length = row.reserved = length
        keep = -(-length // self.P)
        if keep < len(row.pages):
            row.cuts += 1
            self.pool.free(row.pages[keep:])
            del row.pages[keep:]

    # ---- shared pages ----------------------------------------------------------------------
    def computed(self, row: CacheRow, tokens: list[int], limit: int) -> list[int]:
        """Cached pages that continue the row's table (page indices below `limit`), not yet taken."""
        return computed_pages(self.pool, row, tokens, self.P, limit) if self.prefix_cache else []

    def take_cached(self, row: CacheRow, pages: list[int]) -> None:
        """The row continues with these cached pages (full, computed): held, not computed again."""
        if not pages:
            return
        self.pool.share(pages)
        row.pages += pages
        row.length = len(row.pages) * self.P
        row.reserved = max(row.reserved, row.length)
        row.peak_pages = max(row.peak_pages, len(row.pages))

    def cache_pages(self, row: CacheRow, tokens: list[int], n_tokens: int) -> None:
        """With prefix caching: the row's full pages among its first n_tokens (stored, finite) are cached."""
        if self.prefix_cache:
            cache_full_pages(self.pool, row, tokens, self.P, n_tokens // self.P)

    def fork(self, src: CacheRow, dst: CacheRow, kv_limit_bytes: int, want_pages: int = 0) -> None:
        """dst (admitted, holding nothing) continues from everything src stored: src's full pages
        shared, the page src is filling copied into a page of dst's own (copy on write; q8/q4: the
        tail page). Raises RowError (dst then holds nothing) when the copy's page cannot be had."""
        P = self.P
        full = src.length // P
        self.pool.share(src.pages[:full])
        if self.first:
            self._quantized_store().copy_first(src.tail_slot, dst.tail_slot)
        dst.pages, dst.length, dst.reserved = src.pages[:full], full * P, full * P
        dst.hashes = list(src.hashes)
        dst.peak_pages = max(dst.peak_pages, full)
        rest = src.length - full * P
        if rest:
            try:
                self.reserve(dst, rest, kv_limit_bytes, want_pages)
            except Exception:
                self.release(dst)
                raise
            store = self.store
            if isinstance(store, QuantizedStore):
                store.copy_tail(src.tail_slot, dst.tail_slot)
            else:
                store.copy_pages([src.pages[full]], [dst.pages[full]])
        dst.length = src.length

    # ---- pages on disk (kv/offload.py) ----------------------------------------------------
    @property
    def layout_id(self) -> str:
        """What this cache's stored bytes mean (a file of pages made under another layout is never read)."""
        return offload.layout_of(self.store, self.num_layers, rotated=self.rotation is not None)

    def page_arrays(self, row: CacheRow, n_pages: int) -> dict[str, mx.array]:
        """The arrays of the row's first n_pages pages (full, stored), every layer, as stored."""
        return offload.page_arrays(self.store, row.pages[:n_pages], row.tail, min(self.first, n_pages * self.P))

    def put_pages(self, row: CacheRow, rk: offload.RowKV, n_pages: int, kv_limit_bytes: int,
                  want_pages: int = 0) -> int:
        """The row (holding whole pages only) continues with pages len(row.pages)..n_pages of `rk`: reserved
        (priced; RowError when they cannot be had) and written, not computed. Returns the tokens it gained."""
        start = len(row.pages)
        if n_pages <= start or row.length != start * self.P:
            return 0
        self.reserve(row, (n_pages - start) * self.P, kv_limit_bytes, want_pages)
        offload.put_pages(self.store, rk, start, row.pages[start:n_pages], row.tail if start == 0 else None)
        row.length = n_pages * self.P
        return (n_pages - start) * self.P

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

    def _quantized_store(self) -> QuantizedStore:
        """The store where only a quantized one can be (tail pages, kv.full_precision_tokens copies)."""
        assert isinstance(self.store, QuantizedStore)
        return self.store

    # ---- one forward pass ------------------------------------------------------------------
    def begin(self, rows: list[CacheRow], L: int, poison: Optional[list[bool] | mx.array] = None,
              lens: Optional[list[int]] = None) -> None:
        """A pass of L tokens per row; lens: each row's real tokens (a prefill pass of rows with
        different chunks is right-padded to L; None: all L). poison: testing only
        (EngineHooks.nonfinite), rows whose layer-0 attention turns NaN."""
        lens = lens or [L] * len(rows)
        if self.pool.capacity > self.capacity_pages:  # every page id the pool hands out is in the buffers
            raise UnreservedWriteError(f"the page pool ({self.pool.capacity} pages) exceeds the live buffers "
                                       f"({self.capacity_pages})")
        P, pos = self.P, [r.length for r in rows]
        for r, a, n in zip(rows, pos, lens):
            if a + n > r.reserved:
                raise UnreservedWriteError(f"row {r.key}: forward of {n} tokens at {a} but only {r.reserved} reserved")
            if r.reserved > len(r.pages) * P:
                raise UnreservedWriteError(f"row {r.key}: {r.reserved} tokens reserved in {len(r.pages)} pages")
        if L == 1:  # a decode step writes one page a row
            written = [r.pages[a // P] for r, a in zip(rows, pos)]
        else:
            written = [p for r, a, n in zip(rows, pos, lens) for p in r.pages[a // P:(a + n - 1) // P + 1]]
        bad = self.pool.not_private(written)
        if bad:
            r = next(r for r, n in zip(rows, lens) if bad[0] in r.pages[r.length // P:(r.length + n - 1) // P + 1])
            raise UnreservedWriteError(f"row {r.key}: a write into page {bad[0]}, which is shared "
                                       f"or cached (held {self.pool.ref(bad[0])}x)")
        meta = self.attention.plan(rows, L, pos, lens)
        offset = pos[0] if len(rows) == 1 else self.attention.positions(meta)
        if offset is None:
            offset = mx.array(pos, dtype=mx.int32)
        self.plan = _Pass(rows, L, lens, offset, meta, first=self._first_writes(rows, L, pos, lens))
        self._poison(poison)

    def _poison(self, poison: Optional[list[bool] | mx.array]) -> None:
        """The pass begun: its testing-only poisoned rows (`begin`), and no row traced yet."""
        assert self.plan is not None
        if isinstance(poison, mx.array):  # built by the runner's hooks: kept lazy (it may be made to fail)
            self.plan.poison = poison
        elif poison is not None and any(poison):
            self.plan.poison = mx.array(poison)
        self._reported = set()

    def begin_chained(self, rows: list[CacheRow], L: int, pos: mx.array, lowest: list[int],
                      poison: Optional[list[bool] | mx.array] = None) -> bool:
        """A pass of L tokens a row at device positions `pos` (int32, B), each at least lowest[b] and at most
        the row's stored length (a chained verification pass: the pass before it, still computing, decides
        how many of its tokens stay). Every page the window may write is reserved and the row's own; the
        stored length advances by L at `end`, as if the pass before kept all its tokens, until that pass is
        read (Verifier.land cuts it back). False: the route cannot plan such a pass (nothing begun)."""
        if self.first or self.pool.capacity > self.capacity_pages:
            return False
        P = self.P
        for r in rows:
            if r.length + L > r.reserved or r.reserved > len(r.pages) * P:
                raise UnreservedWriteError(f"row {r.key}: chained forward of {L} tokens at <= {r.length} but only "
                                           f"{r.reserved} reserved")
        written = [p for r, lo in zip(rows, lowest) for p in r.pages[lo // P:(r.length + L - 1) // P + 1]]
        bad = self.pool.not_private(written)
        if bad:
            raise UnreservedWriteError(f"a chained write into page {bad[0]}, which is shared or cached "
                                       f"(held {self.pool.ref(bad[0])}x)")
        meta = self.attention.chained_plan(rows, L, pos, [-(-(r.length + L) // P) for r in rows])
        if meta is None:
            return False
        self.plan = _Pass(rows, L, [L] * len(rows), pos, meta)
        self._poison(poison)
        return True

    def _first_writes(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int]):
        """Where the pass's tokens at positions < kv.full_precision_tokens go in the dense copies."""
        N = self.first
        if not N or min(pos) >= N:
            return None
        tok, slots = [], []
        for b, (r, p0, n) in enumerate(zip(rows, pos, lens)):
            for i in range(min(n, max(N - p0, 0))):
                tok.append(b * L + i)
                slots.append(r.tail_slot * N + p0 + i)
        if not tok:
            return None
        return (mx.array(tok, dtype=mx.int32),
                mx.array(head_rows(slots, N, self.layout.num_kv_heads), dtype=mx.int32))

    def end(self) -> None:
        """Close the forward pass begun by `begin`: each row's stored length advances by its tokens."""
        plan = self.plan
        assert plan is not None, "end() without begin()"
        for r, n in zip(plan.rows, plan.lens):
            r.length += n
        self.plan = None
        self.attention.end()

    # ---- called by the model, layer by layer -----------------------------------------------
    def write(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Store one layer's K/V of the pass in the rows' reserved pages (through the route)."""
        plan = self.plan
        if plan is None:
            raise UnreservedWriteError("KV write outside a reserved forward pass")
        B, _, L, _ = keys.shape
        if B != len(plan.rows) or L != plan.L:
            raise UnreservedWriteError(f"KV write of {B}x{L} tokens into a pass reserved for "
                                       f"{len(plan.rows)}x{plan.L}")
        if self.rotation is not None:
            keys = self.rotation(keys)
        if plan.first is not None:
            k, v = flat_tokens(keys, values)
            self._quantized_store().write_first(layer, plan.first[1], k[plan.first[0]], v[plan.first[0]])
        self.attention.write(layer, plan.meta, keys, values)

    def attend(self, layer: int, queries: mx.array, scale: float) -> mx.array:
        """One layer's attention of the pass's queries over the rows' pages (keys rotated first when kv.rotate_keys)."""
        plan = self.plan
        assert plan is not None, "attention outside a forward pass"
        if self.rotation is not None:
            queries = self.rotation(queries)
        out = self.attention.attend(layer, plan.meta, queries, scale)
        if plan.poison is not None and layer == 0:  # testing-only fault injection
            out = mx.where(plan.poison[:, None, None, None], mx.array(mx.nan, out.dtype), out)
        if self.trace:
            self._trace(layer, out)
        return out

    def _trace(self, layer: int, out: mx.array) -> None:
        plan = self.plan
        assert plan is not None
        bad = cast(list, (~mx.isfinite(out)).sum(axis=(1, 2, 3)).tolist())  # (B,): a list
        for r, n_bad in zip(plan.rows, bad):
            if self.trace == "nonfinite" and (not n_bad or r.key in self._reported):
                continue
            self._reported.add(r.key)
            trace_log.warning("[kvbatch attention] layer=%d cache=%r route=%s row=%s offset=%d L=%d capacity=%d "
                              "reserved=%d nonfinite=%d", layer, self.views[layer], self.route, r.key, r.length,
                              plan.L, self.capacity_pages * self.P, r.reserved, n_bad)


def mlx_cached_memory() -> int:
    """Bytes of freed buffers MLX keeps for reuse (reclaimable by mx.clear_cache())."""
    return int(mx.get_cache_memory())
