"""Rotary position embedding on the CPU from one table per step, shared by every layer.

MLX's CPU `fast.rope` computes each element's frequency, cosine and sine with scalar
libm calls: ~60-100 us a call at decode shapes (a (B, heads, 1, 64) tensor), twice per
layer, about 8-10% of a tiny-llama decode step. Every layer rotates by the same angles,
so `TableRoPE` gets them once per step, exactly: it runs the model's own RoPE on a
basis vector (1 in each pair's first element, 0 in the second), whose output is the
(cos, sin) of every pair at every row's position. Each layer then rotates with a
compiled elementwise kernel: bit-identical to `fast.rope` (tests/engine/test_rope.py), 2.5-4.5x
faster a call (docs/performance.md). Only plain `nn.RoPE` modules are
wrapped (scaled variants keep MLX's kernel); only one-token passes (decode) use the
table; other backends keep their fused kernel.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class _Tables:
    """The step's (cos, sin) for one RoPE configuration; recomputed when the offset changes."""

    def __init__(self, rope: nn.RoPE):
        self.rope, self.cs = rope, None
        self._offset: Any = None
        h = rope.dims // 2
        pair = [1.0, 0.0] * h if rope.traditional else [1.0] * h + [0.0] * h
        self.basis = mx.array(pair, dtype=mx.float32)

    def get(self, offset: Any) -> tuple[mx.array, mx.array]:
        """(cos, sin), each (rows, 1, 1, dims / 2), or (1, 1, 1, dims / 2) for an int offset (every
        row at that position). The engine passes one offset object to every layer of a step
        (kept here, so its identity cannot be reused meanwhile)."""
        same = offset is self._offset or (isinstance(offset, int) and isinstance(self._offset, int)
                                          and offset == self._offset)
        if self.cs is None or not same:
            n = offset.size if isinstance(offset, mx.array) else 1
            # mlx's nn.RoPE annotates offset as int; the mx.fast.rope it calls takes (rows,) arrays too
            cs = self.rope(mx.broadcast_to(self.basis, (n, 1, 1, self.basis.size)),
                           offset=offset)  # pyright: ignore[reportArgumentType]
            h = self.rope.dims // 2
            self.cs = (cs[..., 0::2], cs[..., 1::2]) if self.rope.traditional else (cs[..., :h], cs[..., h:])
            self._offset = offset
        return self.cs


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, dims: int, traditional: bool) -> mx.array:
    xr = x[..., :dims]
    if traditional:
        a, b = xr[..., 0::2], xr[..., 1::2]
        y = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(xr.shape)
    else:
        h = dims // 2
        a, b = xr[..., :h], xr[..., h:]
        y = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return y if dims == x.shape[-1] else mx.concatenate([y, x[..., dims:]], axis=-1)


_rotate_compiled = mx.compile(_rotate)


class TableRoPE(nn.Module):
    """An `nn.RoPE` that rotates one-token passes on the CPU from a per-step table."""

    def __init__(self, inner: nn.RoPE, tables: _Tables):
        super().__init__()
        self.inner = inner
        self._tables = tables
        self.dims, self.traditional = inner.dims, inner.traditional

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        """Rotate x by the step's table on one-token float32 CPU passes; by the wrapped RoPE otherwise."""
        if x.shape[2] != 1 or x.dtype != mx.float32 or mx.default_device().type != mx.DeviceType.cpu:
            return self.inner(x, offset=offset)
        cos, sin = self._tables.get(offset)
        return _rotate_compiled(x, cos, sin, self.dims, self.traditional)


def install(model: nn.Module) -> int:
    """Wrap the model's plain `nn.RoPE` modules (idempotent); layers with the same RoPE
    configuration share one table. Returns how many modules are wrapped."""
    tables: dict[tuple, _Tables] = {}
    wrapped = 0
    for _, module in model.named_modules():
        rope = getattr(module, "rope", None)
        if isinstance(rope, TableRoPE):
            wrapped += 1
            continue
        if type(rope) is not nn.RoPE:
            continue
        sig = (rope.dims, rope.traditional, float(rope.base), float(rope.scale))
        module.rope = TableRoPE(rope, tables.setdefault(sig, _Tables(rope)))
        wrapped += 1
    return wrapped


def uninstall(model: nn.Module) -> None:
    """Put MLX's RoPE modules back (benchmarks run mlx-lm on the model as it ships)."""
    for _, module in model.named_modules():
        rope = getattr(module, "rope", None)
        if isinstance(rope, TableRoPE):
            module.rope = rope.inner
