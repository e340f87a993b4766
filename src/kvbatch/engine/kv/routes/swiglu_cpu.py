"""The SwiGLU of CPU MLPs, its exponential by 2^x in compiled kernels.

mlx-lm's `swiglu(gate, up) = silu(gate) * up` computes silu's e^-x with MLX's scalar CPU
`exp`: ~1.6 ms a layer for SmolLM2 at batch 64 (64 x 1536 elements), about a fifth of a
decode step. Here silu(g) * u = g * u / (1 + 2^(-g log2 e)) with `exp2_cpu`'s
polynomial (relative error ~1e-7): 6x faster a call. Only MLPs whose forward is mlx-lm's
plain `down_proj(swiglu(gate_proj(x), up_proj(x)))` are wrapped (recognized by the names
their code uses and the `swiglu` it calls), in float32 on the CPU; anything else keeps its own.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations

from kvbatch.engine.kv.routes.exp2_cpu import LOG2E, exp2_fused

_SWIGLU_NAMES = frozenset({"down_proj", "swiglu", "gate_proj", "up_proj"})


@partial(mx.compile, shapeless=True)
def _exponent(gate: mx.array) -> mx.array:
    return mx.clip(gate * -LOG2E, -127.0, 127.0)


@partial(mx.compile, shapeless=True)
def _combine(gate: mx.array, up: mx.array, p: mx.array, scale: mx.array) -> mx.array:
    return gate * up / (1.0 + p * scale)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, float32, on the CPU."""
    p, bits = exp2_fused(_exponent(gate))
    return _combine(gate, up, p, mx.view(bits, mx.float32))


class _PlainMLP(Protocol):
    """What `_plain_swiglu` recognizes: mlx-lm's SwiGLU MLP, by its three projections."""

    gate_proj: Callable[[mx.array], mx.array]
    up_proj: Callable[[mx.array], mx.array]
    down_proj: Callable[[mx.array], mx.array]


class SwiGLUMLP(nn.Module):
    """An mlx-lm SwiGLU MLP whose activation runs by `swiglu` above in float32 on the CPU."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        """The MLP with the float32 CPU SwiGLU; the wrapped MLP on other dtypes and devices."""
        m = self.inner
        if x.dtype != mx.float32 or mx.default_device().type != mx.DeviceType.cpu:
            return m(x)
        p = cast(_PlainMLP, m)  # mlx types a Module's attributes (__getattr__) as "Any | None"
        return p.down_proj(swiglu(p.gate_proj(x), p.up_proj(x)))


def _plain_swiglu(module: nn.Module) -> bool:
    call = type(module).__call__
    code = getattr(call, "__code__", None)
    return (code is not None and set(code.co_names) == _SWIGLU_NAMES
            and call.__globals__.get("swiglu") is activations.swiglu)


def install(model: nn.Module) -> int:
    """Wrap the model's plain SwiGLU MLPs (idempotent). Returns how many are wrapped."""
    wrapped = 0
    for _, module in model.named_modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, SwiGLUMLP):
            wrapped += 1
        elif isinstance(mlp, nn.Module) and _plain_swiglu(mlp):
            module.mlp = SwiGLUMLP(mlp)
            wrapped += 1
    return wrapped


def uninstall(model: nn.Module) -> None:
    """Put mlx-lm's MLP modules back (benchmarks run mlx-lm on the model as it ships)."""
    for _, module in model.named_modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, SwiGLUMLP):
            module.mlp = mlp.inner
