"""The interface every attention route implements, and the geometry it is built with.

A route owns how one forward pass reads and writes the paged K/V: `plan()` builds the pass's
metadata once, before the layers run (page tables, slot maps, masks: a small frozen dataclass of
the route's own), then each layer calls `write()` and `attend()` with it, so the per-layer work
holds no Python loops over rows. Routes get rows and geometry, never the cache (engine/kv/cache.py
keeps admission, reservation, growth and release, and hands each pass to its route).
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import mlx.core as mx

from kvbatch.engine.kv.pages import CacheRow


@dataclass(frozen=True)
class Geometry:
    """The K/V shape a route is built for: tokens per page, KV heads, head size and query heads."""

    page_size: int
    kv_heads: int
    head_dim: int
    query_heads: int


class Route:
    """How a forward pass reads and writes the paged K/V: `plan` once per pass, then `write` and `attend` per layer."""

    name: str = ""

    def plan(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int]) -> object:
        """The pass's metadata: rows at positions `pos` (their stored lengths), lens[b] <= L tokens
        each (a prefill pass is right-padded to L: the padding is neither stored nor attended to by
        real tokens)."""
        raise NotImplementedError

    def chained_plan(self, rows: list[CacheRow], L: int, pos: mx.array, n_pages: list[int]) -> Optional[object]:
        """The metadata of a pass of L tokens a row whose positions `pos` (int32, B) are on the device only: a
        chained verification pass, built from the pass before it while that one still computes
        (engine/speculative/chain.py). Every token is real; each row's table is its first n_pages pages
        (reserved for the window at its furthest). None: the route has no such plan (the pass is then built
        after the one before it is read)."""
        return None

    def positions(self, meta) -> Optional[mx.array]:
        """The rows' positions (int32, B) where the plan holds them as a device array already (its
        `positions` field: the pass's RoPE offsets then need no upload of their own), else None."""
        return getattr(meta, "positions", None)

    def write(self, layer: int, meta, keys: mx.array, values: mx.array) -> None:
        """Store the pass's new K/V (B, H, L, D) of one layer."""
        raise NotImplementedError

    def attend(self, layer: int, meta, queries: mx.array, scale: float) -> mx.array:
        """(B, Hq, L, D) attention of the pass's queries over each row's pages."""
        raise NotImplementedError

    def end(self) -> None:
        """The pass is over (drop per-pass scratch)."""


def real_tokens(L: int, lens: list[int]) -> mx.array | None:
    """Indices of the real tokens in a pass's (B * L) flat tokens; None when none is padding."""
    if all(n == L for n in lens):
        return None
    return mx.array([b * L + i for b, n in enumerate(lens) for i in range(n)], dtype=mx.int32)


def flat_tokens(keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """(B, H, L, D) -> (B * L, H, D), token-major as the slot maps are; (B, H, 1, D) is
    (B, H, D) already: no transposed copy."""
    B, H, L, D = keys.shape
    if L == 1:
        return keys.reshape(B, H, D), values.reshape(B, H, D)
    return (keys.transpose(0, 2, 1, 3).reshape(B * L, H, D), values.transpose(0, 2, 1, 3).reshape(B * L, H, D))
