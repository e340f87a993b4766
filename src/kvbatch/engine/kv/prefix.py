"""Prefix caching over the page pool: which cached pages a row can take, and which of its pages
become cached. Pure bookkeeping (no MLX), as vLLM v1's KVCacheManager.get_computed_blocks and
BlockPool.cache_full_blocks.

A row's token sequence is its prompt (plus, after a preemption, the tokens it generated). Its
full pages are hashed along the chain (kv/hashing.py) as far as they are needed; the pages it
can take are the longest run of its next hashes that the pool holds. Only full pages are ever
cached, and only once their K/V is stored and known to be finite (a prompt whose last chunk gave
finite logits, a row released without an error): in q8/q4 a full page is sealed (quantized) as
it fills, so a cached page is always sealed, and the page a row is filling stays its own.
"""
from __future__ import annotations

from kvbatch.engine.kv.hashing import extend_hashes
from kvbatch.engine.kv.pages import CacheRow, PagePool


def computed_pages(pool: PagePool, row: CacheRow, tokens: list[int], page_size: int, limit: int) -> list[int]:
    """Cached pages that continue the row's page table (it holds whole pages only), up to page
    index `limit` (exclusive): the longest run whose hashes the pool holds. Nothing is taken."""
    start = len(row.pages)
    if limit <= start or row.length != start * page_size:
        return []
    out: list[int] = []
    for i in range(start, limit):
        page = pool.cached(extend_hashes(row.hashes, tokens, page_size, i + 1, row.salt)[i])
        if page is None:
            break
        out.append(page)
    return out


def cache_full_pages(pool: PagePool, row: CacheRow, tokens: list[int], page_size: int, n_pages: int) -> None:
    """Name the row's first n_pages pages (full, K/V stored) by their prefix hashes."""
    n = min(n_pages, len(row.pages), len(tokens) // page_size)
    for i, h in enumerate(extend_hashes(row.hashes, tokens, page_size, n, row.salt)[:n]):
        pool.cache(row.pages[i], h)


def next_hash(row: CacheRow, tokens: list[int], page_size: int, limit: int):
    """The hash of the row's next page to compute (at its stored length), when that page is full
    and below `limit`; else None. The scheduler defers a row whose next page another row is
    computing (it takes that page once it is cached, instead of computing it twice)."""
    i = row.length // page_size
    if row.length % page_size or i >= limit:
        return None
    return extend_hashes(row.hashes, tokens, page_size, i + 1, row.salt)[i]


def prefix_hashes(row: CacheRow, tokens: list[int], page_size: int, limit: int) -> list:
    """Hashes of the row's first `limit` full pages (computed or not)."""
    return extend_hashes(row.hashes, tokens, page_size, limit, row.salt)[:limit]
