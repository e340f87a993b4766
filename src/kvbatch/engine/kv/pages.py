"""The page pool (which pages are held, by how many rows, and which hold a cached prefix) and a
row's claim on it (CacheRow). Knows nothing about MLX or bytes.

Like vLLM v1's block pool (vllm/v1/core/block_pool.py): one pool shared by all layers (a row's
page table is the same in every layer); every page has a reference count, and a page is free
when its last holder lets go. A full page of known tokens may be cached: its hash
(kv/hashing.py) maps to it, so a later row with the same prefix takes it instead of computing
it again. Free pages come in two kinds: never cached (a stack: the last freed is reused first)
and cached ones nobody holds (kept in least-recently-used order). Allocation takes the first
kind first and evicts cached pages, oldest first, only when none is left.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Optional

from kvbatch.engine.kv.hashing import PageHash


@dataclass
class CacheRow:
    """A row's claim on the cache: its page table, stored and reserved lengths."""

    key: str
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens stored
    reserved: int = 0  # tokens with a slot reserved (length <= reserved)
    tail: Optional[int] = None  # quantized modes: its dense tail-page slot
    peak_pages: int = 0
    hashes: list[PageHash] = field(default_factory=list)  # of its token sequence's full pages, as far as known
    # what else its K/V depends on (a per-row adapter's name): the root of its page hash chain
    salt: Optional[PageHash] = None
    admissions: int = 0  # times the cache admitted it (a row admitted again after a preemption has new pages)
    cuts: int = 0  # times pages past its length went back to the pool (a rollback): later pages may be others

    @property
    def tail_slot(self) -> int:
        """Its tail slot: every admitted row of a quantized cache has one (PagedKVCache.admit)."""
        assert self.tail is not None, f"row {self.key} has no tail slot"
        return self.tail


class PagePool:
    """Reference-counted page ids shared by every layer: allocation, release, and the prefix cache's hash-to-page map
    with LRU eviction."""

    def __init__(self) -> None:
        self._free: list[int] = []  # never-cached free pages; stack: last freed is first reused
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self._ref: list[int] = []  # holders of each page
        self._hash_of: dict[int, PageHash] = {}
        self._page_of: dict[PageHash, int] = {}
        self._capacity = 0
        self.in_use = 0  # pages with a holder
        self.refs = 0  # holders of all pages together (refs - in_use: page holds saved by sharing)
        self.peak_in_use = 0
        self.evictions = 0  # cached pages dropped to make room

    @property
    def capacity(self) -> int:
        """Page ids the pool manages (the stores' capacity in pages)."""
        return self._capacity

    @property
    def num_free(self) -> int:
        """Pages allocate() can hand out: never-cached free pages and cached pages nobody holds."""
        return len(self._free) + len(self._lru)

    @property
    def num_evictable(self) -> int:
        """Cached pages nobody holds (kept until their room is needed)."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages that carry a prefix hash (held or not)."""
        return len(self._page_of)

    @property
    def shared(self) -> int:
        """Holds beyond the first on the pages in use: what sharing saves, in pages."""
        return self.refs - self.in_use

    def ref(self, page: int) -> int:
        """How many rows hold `page`."""
        return self._ref[page]

    def add_pages(self, new_capacity: int) -> None:
        """Register the pages a pool growth created (ids old_capacity..new_capacity-1)."""
        if new_capacity < self._capacity:
            raise ValueError("the page pool never shrinks")
        self._free[:0] = reversed(range(self._capacity, new_capacity))  # new pages used after freed ones
        self._ref += [0] * (new_capacity - self._capacity)
        self._capacity = new_capacity

    def allocate(self, n: int) -> list[int]:
        """n pages held once each: never-cached pages first, then the least recently used cached ones
        (their hashes dropped)."""
        if n > self.num_free:
            raise MemoryError(f"{n} pages asked, {self.num_free} free")
        pages = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
            self.evictions += 1
            pages.append(page)
        for p in pages:
            self._ref[p] = 1
        self._held(n, n)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder of each page (a cached page nobody held leaves the eviction queue)."""
        new = n = 0
        for p in pages:
            if self._ref[p] == 0:
                if p not in self._lru:
                    raise RuntimeError(f"page {p} is free and not cached: nothing to share")
                del self._lru[p]
                new += 1
            self._ref[p] += 1
            n += 1
        self._held(new, n)

    def _held(self, new_pages: int, holds: int) -> None:
        self.in_use += new_pages
        self.refs += holds
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def free(self, pages: list[int]) -> None:
        """One holder less on each page. A page nobody holds becomes free: a cached one joins the
        eviction queue (the row's last pages first: they are evicted before its first ones, which
        are the likelier to be shared), others the free stack."""
        for p in reversed(pages):
            if self._ref[p] <= 0:
                raise RuntimeError("page pool accounting broke: a page was freed twice")
            self._ref[p] -= 1
            self.refs -= 1
            if self._ref[p] == 0:
                self.in_use -= 1
                if p in self._hash_of:
                    self._lru[p] = None
                else:
                    self._free.append(p)

    def cache(self, page: int, h: PageHash) -> None:
        """Name a held full page by its prefix hash. A page already named, or a hash another page
        holds already, is left as it is (the first page with a prefix keeps it; a page's number in
        a row's table never changes)."""
        if page in self._hash_of or h in self._page_of:
            return
        if self._ref[page] <= 0:
            raise RuntimeError(f"page {page} is not held: only a row's own full pages are cached")
        self._hash_of[page] = h
        self._page_of[h] = page

    def cached(self, h: PageHash) -> Optional[int]:
        """The page holding the prefix with this hash, or None."""
        return self._page_of.get(h)

    def is_cached(self, page: int) -> bool:
        """Whether `page` holds a cached full page of known tokens (has a hash)."""
        return page in self._hash_of

    def not_private(self, pages: list[int]) -> list[int]:
        """Those of `pages` that a write may not touch: held by another row too, or cached (one call for a
        whole pass's pages: the per-page calls cost a step ~1 ms at a thousand rows)."""
        ref, named = self._ref, self._hash_of
        return [p for p in pages if ref[p] != 1 or p in named]
