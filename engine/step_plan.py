"""What one forward pass reads and writes in the paged cache (PagedKVCache.begin builds it
once per step, before the layers run): page tables, the pool slots its tokens go to, and the
masks, per route. The layers then only index with these arrays (PagedKVCache.write/attend), so
the per-layer work holds no Python loops over rows."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import numpy as np

from kvbatch.engine import attention as att
from kvbatch.engine.kv_store import head_rows

if TYPE_CHECKING:
    from kvbatch.engine.kv_cache import CacheRow, PagedKVCache


def page_table(rows: list[CacheRow], n_pages: list[int]) -> mx.array:
    """(B, width) int32: each row's first n_pages pages."""
    width = max(max(n_pages), 1)
    # padding repeats the row's own first page (masked out): never another row's page,
    # whose K/V may be NaN in this very pass (masked slots still meet probs @ V)
    # (built as Python lists: per-row numpy slice assignments cost ~0.2 ms a step at batch 32)
    table = [r.pages[:n] + [r.pages[0] if r.pages else 0] * (width - n) for r, n in zip(rows, n_pages)]
    return mx.array(table, dtype=mx.int32)


def token_slots(r: CacheRow, P: int, start: int, stop: int) -> np.ndarray:
    """Pool slots (page * P + offset) of row r's tokens start..stop-1."""
    p = np.arange(start, stop)
    return np.asarray(r.pages, dtype=np.int64)[p // P] * P + p % P


def causal_mask(pos: np.ndarray, L: int, T: int, extra_dims: int) -> mx.array:
    """(B, 1 x extra_dims, L, T): query i of row b (at pos[b] + i) sees keys 0..pos[b] + i."""
    qpos = mx.array(pos)[:, None] + mx.arange(L)[None]  # (B, L)
    mask = mx.arange(T)[None, None, :] <= qpos[:, :, None]  # (B, L, T)
    return mask.reshape(mask.shape[0], *([1] * extra_dims), L, T)


def page_heads(table: mx.array, H: int) -> tuple[mx.array, mx.array]:
    """For reading pages in place with gather_mm / gather_qmm: (B, H, n) the (page * H + head)
    of each row's pages in `table` (B, n), and (B, H, 1) the query group b * H + head."""
    B = table.shape[0]
    heads = (table[:, None, :] * H + mx.arange(H, dtype=mx.int32)[None, :, None]).astype(mx.uint32)
    return heads, mx.arange(B * H, dtype=mx.uint32).reshape(B, H, 1)


def dense(cache: PagedKVCache, rows: list[CacheRow], L: int, pos: np.ndarray) -> dict:
    """A multi-token pass (prefill chunk) over dense pages."""
    tokens = np.concatenate([token_slots(r, cache.P, int(p), int(p) + L) for r, p in zip(rows, pos)]).tolist()
    table = page_table(rows, (-(-(pos + L) // cache.P)).tolist())
    hrows = head_rows(tokens, cache.P, cache.layout.num_kv_heads)
    return {"rows": mx.array(hrows, dtype=mx.int32), "table": table,
            "mask": causal_mask(pos, L, table.shape[1] * cache.P, 1)}


_ONE = mx.array(1, dtype=mx.int32)
_TAIL_STEP = mx.array([[0, 1]], dtype=mx.int32)  # lens (B, 2): sealed tokens stay, the tail grows by one


def reused(cache: PagedKVCache, rows: list[CacheRow], fixed: tuple, counts: list, before: list,
           step: mx.array, build: Callable[[], tuple]) -> tuple:
    """The CUDA decode's per-step arrays: (fixed arrays..., counts array). fixed: what the
    fixed arrays are made of besides the rows' pages (their page counts, tails); counts: this
    step's per-row counts (host list); before: the same one token earlier. Reused from the
    previous decode step when the cache's epoch, the rows and `fixed` are the same and that
    step's counts were `before`: the fixed arrays as they are, the counts as the old array +
    `step` (one device add). Else `build()` makes them from the host lists.

    Why: in the H200's decode loop each array made from host lists cost the host 0.1-0.15 ms
    (cProfile, RESULTS.md issue 9, eighth session; the same call outside the loop takes
    1-30 us), and a q8/q4 step made three (tails, page table, lens): at 1B batch 8 that was
    0.55 ms of a host-bound 6 ms step. A row's table changes only when it gains a page, and
    every page allocation or release bumps the cache's epoch (PagedKVCache.epoch)."""
    key = (cache.epoch, tuple(map(id, rows)), fixed)
    last = cache.last_decode if cache.reuse_steps else None
    if last is not None and last[0] == key and last[1] == before:
        arrays = last[2][:-1] + (last[2][-1] + step,)
    else:
        arrays = build()
    cache.last_decode = (key, counts, arrays)
    return arrays


def decode(cache: PagedKVCache, rows: list[CacheRow], pos: list[int]) -> dict:
    """A one-token pass over dense pages, built from Python lists: right after a step's
    compute numpy costs ~10 us an op on arrays of a few rows (cold caches), and these are
    a few dozen numbers (0.1 ms a step less than with numpy at batch 8)."""
    P, H, B = cache.P, cache.layout.num_kv_heads, len(rows)
    new_len = [p + 1 for p in pos]
    n_pages = [-(-n // P) for n in new_len]
    if cache.kernel_writes:  # CUDA: the fused kernel stores the token (slot len - 1)
        table, lengths = reused(cache, rows, tuple(n_pages), new_len, pos, _ONE, lambda: (
            page_table(rows, n_pages), mx.array(new_len, dtype=mx.int32)))
        return {"table": table, "lengths": lengths, "kernel_writes": True}
    table = page_table(rows, n_pages)
    width = table.shape[1]
    slots = [r.pages[p // P] * P + p % P for r, p in zip(rows, pos)]
    t = {"rows": mx.array(head_rows(slots, P, H), dtype=mx.int32), "table": table}
    if cache.fused_decode:
        t["lengths"] = mx.array(new_len, dtype=mx.int32)
        return t
    mask = mx.arange(width * P) < mx.array(new_len, dtype=mx.int32)[:, None]  # (B, T)
    if not cache.in_place:
        t["mask"] = mask.reshape(B, 1, 1, width * P)
        return t
    # key-major scores (attention.paged_grouped_decode)
    t["mask"] = mask.reshape(B, 1, width * P, 1)
    t["page_heads"], t["query_of"] = page_heads(table, H)
    return t


def quantized_fused_decode(cache: PagedKVCache, rows: list[CacheRow], pos: list[int]) -> dict:
    """A one-token pass of the CUDA kernel over q8/q4 pages (cuda_attention reads the sealed
    pages and the row's tail page in place): one token per row into its tail; a row that fills
    its tail page seals it. Python lists, as in `decode`: the numpy version of this plan took
    0.3-0.6 ms a step on the H200's host, in a decode loop bound by the host (RESULTS.md, issue 9)."""
    P = cache.P
    tails = [r.tail for r in rows]
    n_before = [p // P for p in pos]  # pages sealed before this step
    fill = [p % P for p in pos]  # tokens in the tail before this one

    def build() -> tuple:
        return (mx.array(tails, dtype=mx.int32), page_table(rows, n_before),
                mx.array([[n * P, f + 1] for n, f in zip(n_before, fill)], dtype=mx.int32))

    arrays = reused(cache, rows, (tuple(n_before), tuple(tails)), [f + 1 for f in fill], fill, _TAIL_STEP, build)
    t = dict(zip(("tails", "table_q", "lens"), arrays))
    if cache.kernel_writes and P - 1 not in fill:  # the kernel stores the token in the tail
        t["kernel_writes"] = True
        return t
    t.update(tail_writes(cache, rows, pos, tails, fill))  # a step that seals writes first (the seal reads it)
    return t


def tail_writes(cache: PagedKVCache, rows: list[CacheRow], pos: list[int], tails: list[int],
                fill: list[int]) -> dict:
    """A decode step's writes into q8/q4 tails: the head rows of each row's new token in its
    tail page (`tail_write`), and for rows whose tail fills (fill == P - 1) the tail slots to
    seal (`seal_from`) and the pool slots of the page they seal into (`seal_to`). With keys
    stored per token (as values: a tail page and a packed page then have the same
    (kv_heads, page_size) layout), the tail ids and page ids instead (`seal_pages`): each
    layer's seal is then one gather, one quantize and three one-index writes per K and V
    (QuantizedStore.seal_tail_pages), where the slot form costs every layer its own index
    arithmetic and MLX's two-index-around-a-slice writes (120 more graph nodes a layer than a step
    that seals nothing, against 28; counted on the CPU, tiny model, batch 8)."""
    P, H = cache.P, cache.layout.num_kv_heads
    t = {"tail_write": mx.array(head_rows([a * P + f for a, f in zip(tails, fill)], P, H), dtype=mx.int32)}
    done = [i for i, f in enumerate(fill) if f == P - 1]
    if done and cache.store.k_axis == "token":
        t["seal_pages"] = (mx.array([tails[i] for i in done], dtype=mx.int32),
                           mx.array([rows[i].pages[pos[i] // P] for i in done], dtype=mx.int32))
    elif done:
        t["seal_from"] = mx.array([tails[i] * P + j for i in done for j in range(P)], dtype=mx.int32)
        t["seal_to"] = mx.array([rows[i].pages[pos[i] // P] * P + j for i in done for j in range(P)],
                                dtype=mx.int32)
    return t


def quantized(cache: PagedKVCache, rows: list[CacheRow], L: int, pos: np.ndarray) -> dict:
    """A pass attends to pages sealed before it (quantized) and to everything it wrote or
    that is still in a tail page (full precision), like mlx-lm's quantized cache."""
    P = cache.P
    n_before = pos // P  # pages sealed before this pass
    tails = [r.tail for r in rows]
    t = {"tails": mx.array(tails, dtype=mx.int32)}
    if n_before.max() > 0:
        t["table_q"] = page_table(rows, n_before.tolist())
    if L == 1:  # decode: one token per row into its tail; rows that fill their page seal it
        fill = pos % P
        t.update(tail_writes(cache, rows, pos.tolist(), tails, fill.tolist()))
        if "table_q" in t and cache.q_in_place:  # packed pages and tails read in place
            t.update(quantized_paged_plan(t["table_q"], n_before.tolist(), fill.tolist(), P,
                                          cache.layout.num_kv_heads, cache.layout.head_dim, cache.qmm_streams))
            return t
        if "table_q" in t:
            width = t["table_q"].shape[1]
            Tq = width * P
            t["mask_q"] = (mx.arange(Tq)[None] < mx.array(n_before * P)[:, None]).reshape(len(rows), 1, 1, Tq)
            # key scores in runs of pages, one per stream (see attention.quantized_decode_attention)
            n = att.qmm_split(len(rows) * cache.layout.num_kv_heads, Tq, cache.layout.head_dim,
                              min(len(cache.qmm_streams), width))
            cuts = [width * i // n for i in range(n + 1)]
            t["runs_q"] = [t["table_q"][:, a:z] for a, z in zip(cuts, cuts[1:])]
        t["mask_t"] = (mx.arange(P)[None] <= mx.array(fill)[:, None]).reshape(len(rows), 1, 1, P)
        t["mask_all"] = mx.concatenate([t["mask_q"], t["mask_t"]], axis=-1) if "mask_q" in t else t["mask_t"]
        return t
    if len(rows) != 1:
        raise ValueError("quantized multi-token passes (prefill) run one row at a time")
    r, p0 = rows[0], int(pos[0])
    fill = p0 % P
    done_pages = (fill + L) // P
    start = p0 - fill
    t["run"] = (r.tail, fill, mx.array(token_slots(r, P, start, start + done_pages * P).astype(np.int32))
                if done_pages else None)
    t["mask"] = causal_mask(pos, L, p0 + L, 1)
    return t


def quantized_paged_plan(table: mx.array, n_before: list[int], fill: list[int], P: int, H: int, D: int,
                         streams: list) -> dict:
    """The per-step inputs of `attention.quantized_paged_decode`, built once for every layer:
    table (B, n) the rows' sealed pages (padded with their first), n_before their sealed page
    counts and fill their tail's tokens before this step's."""
    B, width = table.shape
    n = att.qmm_split(B * H, width * P, D, min(len(streams), width))
    tail = mx.arange(P)[None] <= mx.array(fill)[:, None]  # (B, P): this step's token included
    pages = mx.arange(width)[None] < mx.array(n_before)[:, None]  # (B, width)
    mask = mx.concatenate([tail[:, None], mx.broadcast_to(pages[:, :, None], (B, width, P))], axis=1)
    heads, query_of = page_heads(table, H)
    return {"q_page_heads": heads, "query_of": query_of, "cuts": [width * i // n for i in range(n + 1)],
            "mask_p": mask.reshape(B, 1, width + 1, 1, P)}
