"""The orthogonal rotation of keys before quantizing (kv.rotate_keys), folded into the queries.

A key's channels are far from equal: a few outlier channels set each group's scale, and the
others then get few of the 15 (q4) levels. A normalized Hadamard matrix H (H·Hᵀ = I, entries
±1/√D) spreads every channel over all of them (QuaRot, arXiv:2404.00456). Keys are stored as
k·H (quantized), queries meet them as q·H, and (q·H)·(k·H)ᵀ = q·kᵀ: the scores are unchanged in
exact arithmetic, values are untouched, and nothing else about attention changes. The cache
turns K and Q at its edge (kv.cache.PagedKVCache.write / attend), after RoPE, so every route and
backend stores and reads rotated keys the same way.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np


def rotation_fits(head_dim: int) -> bool:
    """Whether a Hadamard rotation of this head size exists here (Sylvester: a power of two)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def hadamard(n: int) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix of order n (a power of two), float64: orthogonal and
    symmetric."""
    if not rotation_fits(n):
        raise ValueError(f"a Hadamard rotation needs a power of two, not {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


class KeyRotation:
    """x (..., head_dim) -> x·H in float32 (the result in x's dtype)."""

    def __init__(self, head_dim: int):
        self.matrix = mx.array(hadamard(head_dim).astype(np.float32))

    def __call__(self, x: mx.array) -> mx.array:
        """Rotate x's last axis by the Hadamard matrix (in float32, returned in x's dtype)."""
        y = (x if x.dtype == mx.float32 else x.astype(mx.float32)) @ self.matrix
        return y if y.dtype == x.dtype else y.astype(x.dtype)
