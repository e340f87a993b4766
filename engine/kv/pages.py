"""The page pool (which page ids are free) and a row's claim on it (CacheRow). Knows nothing
about MLX or bytes.

Like vLLM's block pool: one free list shared by all layers (a row's page table
is the same in every layer). Freed pages go to the front of the list so they
are reused at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CacheRow:
    """A row's claim on the cache: its page table, stored and reserved lengths."""

    key: str
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens stored
    reserved: int = 0  # tokens with a slot reserved (length <= reserved)
    tail: Optional[int] = None  # quantized modes: its dense tail-page slot
    peak_pages: int = 0


class PagePool:
    def __init__(self) -> None:
        self._free: list[int] = []  # stack: last freed is first reused
        self._capacity = 0
        self.in_use = 0
        self.peak_in_use = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    def add_pages(self, new_capacity: int) -> None:
        """Register the pages a pool growth created (ids old_capacity..new_capacity-1)."""
        if new_capacity < self._capacity:
            raise ValueError("the page pool never shrinks")
        self._free[:0] = reversed(range(self._capacity, new_capacity))  # new pages used after freed ones
        self._capacity = new_capacity

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} pages asked, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.in_use += n
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return pages

    def free(self, pages: list[int]) -> None:
        if not pages:
            return
        self._free.extend(reversed(pages))
        self.in_use -= len(pages)
        if self.in_use < 0 or len(self._free) > self._capacity:
            raise RuntimeError("page pool accounting broke: a page was freed twice")
