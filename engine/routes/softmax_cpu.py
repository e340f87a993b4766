"""The masked softmax of CPU decode attention: 2^x by a polynomial, in compiled kernels.

On MLX's CPU backend `exp` is a scalar libm loop (~9 ns an element) and `power(2, x)`
~7 ns: the softmax was 60% of SmolLM2's decode attention at 2k tokens, and ~200 us a
layer for tiny-llama at batch 32. Here 2^x = 2^n * 2^f with n = round(x), f in
[-1/2, 1/2]: 2^f by its degree-7 Taylor polynomial (relative error ~1.2e-7, float32's
own rounding) and 2^n by writing n + 127 into a float32's exponent bits. Every step is
plain arithmetic that MLX's shapeless `mx.compile` fuses into vectorized C++ loops
(built once with the system compiler). The bit view splits the work into four small
kernels around the two reductions. Masked keys get exactly 0 (x clamps to -127: a zero
exponent field). Without a working compiler the same math runs uncompiled.
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import mlx.core as mx

_LOG2E = 1.0 / math.log(2.0)
_TAYLOR = [math.log(2.0) ** k / math.factorial(k) for k in range(8)]  # 2^f = sum (f ln2)^k / k!


def _masked(mask: mx.array, scores: mx.array, scale: float) -> mx.array:
    return mx.where(mask, scores.astype(mx.float32) * scale, -mx.inf)


def _exp2_parts(s: mx.array, s_max: mx.array) -> tuple[mx.array, mx.array]:
    """2^((s - max) log2 e) as (2^f, the int32 bits of 2^n)."""
    x = mx.maximum((s - s_max) * _LOG2E, -127.0)
    n = mx.round(x)
    f = x - n
    p = _TAYLOR[7]
    for c in reversed(_TAYLOR[:7]):
        p = p * f + c
    return p, mx.left_shift(n.astype(mx.int32) + 127, 23)


def _times(p: mx.array, scale: mx.array) -> mx.array:
    return p * scale


def _divide(e: mx.array, total: mx.array) -> mx.array:
    return e / total


def _steps(fns: tuple[Callable, ...]) -> Callable:
    masked, parts, times, divide = fns

    def softmax(scores: mx.array, mask: mx.array, axis=-1, scale: float = 1.0) -> mx.array:
        s = masked(mask, scores, scale)  # a constant to the compiled kernel (one trace per model)
        p, bits = parts(s, s.max(axis=axis, keepdims=True))
        e = times(p, mx.view(bits, mx.float32))
        out = divide(e, e.sum(axis=axis, keepdims=True))
        return out if out.dtype == scores.dtype else out.astype(scores.dtype)

    return softmax


_EAGER = (_masked, _exp2_parts, _times, _divide)
softmax_eager = _steps(_EAGER)
softmax_fused = _steps(tuple(mx.compile(f, shapeless=True) for f in _EAGER))
_impl: Callable | None = None


def masked_softmax(scores: mx.array, mask: mx.array, axis: int | tuple[int, ...] = -1,
                   scale: float = 1.0) -> mx.array:
    """softmax(where(mask, scores * scale, -inf)) along `axis` (an int or a tuple of axes), in
    float32, output in scores' dtype.

    CPU: within 1e-7 of MLX's precise softmax, 1.5-2.5x faster than the compiled 2^x of
    before and ~4x faster than MLX's (benchmarks/RESULTS.md, issue 3). A single key (never
    in decode, where a row sees its prompt too) takes the eager path: a shapeless kernel
    crashes MLX 0.32 when the softmax axis has length 1. Other backends: MLX's softmax."""
    if mx.default_device().type != mx.DeviceType.cpu:
        s = scores if scale == 1.0 else scores * mx.array(scale, scores.dtype)
        return mx.softmax(mx.where(mask, s, mx.array(-mx.inf, scores.dtype)), axis=axis, precise=True)
    global _impl
    if _impl is None:
        _impl = _probe_fused()
    keys = 1
    for a in (axis if isinstance(axis, tuple) else (axis,)):
        keys *= scores.shape[a]
    return (_impl if keys > 1 else softmax_eager)(scores, mask, axis, scale)


def _probe_fused() -> Callable:
    """The compiled kernels if MLX can build and run them here (they need a C++ compiler; a
    failure surfaces at eval, so it is checked once, on the shapes decode uses), else eager."""
    try:
        s = mx.broadcast_to(mx.array([[[[0.5, 1.0, 3.0]]]]), (2, 2, 1, 3))
        m = mx.array([[[[True, True, False]]]])
        got, want = softmax_fused(s, m), softmax_eager(s, m)
        mx.eval(got, want)
        if mx.allclose(got, want, atol=1e-6).item():
            return softmax_fused
    except Exception as e:  # no compiler, or it failed: keep going without the fused kernels
        print(f"[kvbatch] fused CPU softmax unavailable ({type(e).__name__}: {e}); using the eager one",
              file=sys.stderr)
    return softmax_eager
