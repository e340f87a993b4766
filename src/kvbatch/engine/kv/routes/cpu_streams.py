"""CPU streams for decode attention: how many a step's attention spreads over, and the streams.

MLX's CPU backend runs each stream's ops on one thread, and decode attention's many small
matmuls (per row, KV head and page) run one BLAS call at a time, single-threaded. Spread over
several CPU streams (engine.options.attention_threads, 0 = min(cores, 4)) they run side by side.
A stream is worth its hand-off from MIN_WORK K (or V) elements on (row, KV head, token,
channel): SmolLM2's q8 layer at 2k tokens, batch 1 (393k) ran slower split in two, at 6k batch 1
(1.2M) and 2k batch 4 (1.6M) 1.2-1.8x faster; kv none at batch 64, 300 tokens (3.7M), 1.8x
(docs/performance.md).
"""
from __future__ import annotations

import mlx.core as mx

MIN_WORK = 1 << 19


def stream_split(rows_heads: int, tokens: int, head_dim: int, most: int) -> int:
    """How many streams attention over rows_heads x tokens x head_dim elements uses."""
    return max(1, min(most, rows_heads * tokens * head_dim // MIN_WORK))


_streams: dict[int, list] = {}


def cpu_streams(n: int) -> list:
    """n streams for decode attention: None (the caller's default stream) first, then n - 1
    extra CPU streams (made once per process)."""
    if n not in _streams:
        _streams[n] = [None] + [mx.new_stream(mx.cpu) for _ in range(max(n, 1) - 1)]
    return _streams[n]
