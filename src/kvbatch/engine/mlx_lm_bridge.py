"""Where kvbatch meets mlx-lm's model code: the attention hook, the per-layer cache view,
last-position logits, and the CPU RoPE table.

mlx-lm models call `cache.update_and_fetch(keys, values)`, read `cache.offset` for RoPE (an array
offset per row is allowed) and call their module's `scaled_dot_product_attention`; kvbatch
routes that call to the paged cache (`install`); each layer's cache object is a
`kv.cache.PagedLayerCache`.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.kv.routes import rope_cpu, swiglu_cpu
from kvbatch.engine.kv.routes.select import cpu_route


_CPU_KERNELS = (rope_cpu, swiglu_cpu)  # the modules prepare_model may wrap, in its options' order


def prepare_model(model: nn.Module, options: EngineOptions) -> None:
    """Route the model's attention to paged caches; on the CPU route give its decode RoPE one
    cos/sin table per step (`options.rope_table`) and its SwiGLU MLPs a polynomial e^x
    (`options.cpu_swiglu`); MLX's and mlx-lm's own kernels elsewhere."""
    install(model)
    cpu = cpu_route(options)
    for kernel, wanted in zip(_CPU_KERNELS, (options.rope_table, options.cpu_swiglu)):
        if cpu and wanted:
            kernel.install(model)
        else:
            kernel.uninstall(model)


def as_shipped(model: nn.Module) -> None:
    """Undo `prepare_model`'s CPU kernels (benchmarks run mlx-lm on the model as it ships; the
    attention hook only acts on kvbatch's own caches)."""
    for kernel in _CPU_KERNELS:
        kernel.uninstall(model)


def forward_last(model: nn.Module, tokens: mx.array, cache: list, last: Optional[mx.array] = None) -> mx.array:
    """(B, vocab) logits of each row's last position only (skips the vocab projection of every
    prompt token). last: (B,) the position of each row's last real token (a right-padded prefill
    pass); None: the last position."""
    h, head = forward_hidden(model, tokens, cache)
    return head(pick_last(h, last))[:, -1, :]


def forward_hidden(model: nn.Module, tokens: mx.array, cache: list) -> tuple[mx.array, Callable[[mx.array], mx.array]]:
    """(B, L, ·) states before the vocab projection, and that projection (for a model without the
    usual `model.embed_tokens` layout: its logits, and the identity)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        return model(tokens, cache=cache), lambda h: h
    head = getattr(model, "lm_head", None)
    return inner(tokens, cache=cache), head if head is not None else inner.embed_tokens.as_linear


def pick_last(h: mx.array, last: Optional[mx.array]) -> mx.array:
    """(B, L, ·) -> (B, 1, ·) at each row's last position."""
    if last is None:
        return h[:, -1:, :]
    return mx.take_along_axis(h, last.reshape(-1, 1, 1), axis=1)


def install(model: nn.Module) -> None:
    """Route the model module's `scaled_dot_product_attention` to paged caches.

    mlx-lm model files import the function from `.base` into their own module, so
    patching that module's name routes every attention call of the model; calls
    with any other cache (or none) go to the original function unchanged.
    """
    for mod_name in {type(model).__module__, type(getattr(model, "model", model)).__module__}:
        mod: Any = sys.modules.get(mod_name)  # an mlx-lm model module
        if mod is None or not hasattr(mod, "scaled_dot_product_attention"):
            continue
        original = mod.scaled_dot_product_attention
        if getattr(original, "_kvbatch_paged", False):
            continue
        mod.scaled_dot_product_attention = _make_dispatch(original)


def _make_dispatch(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache: Any, scale: float, mask=None, sinks=None):
        attend = getattr(cache, "paged_attend", None)
        if attend is not None:
            if sinks is not None:
                raise NotImplementedError("attention sinks are not supported by the paged cache")
            return attend(queries, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    # a marker, so install() never wraps a dispatch again (pyright allows no attributes on a function)
    scaled_dot_product_attention._kvbatch_paged = True  # pyright: ignore[reportFunctionMemberAccess]
    return scaled_dot_product_attention


def model_supports_paging(model: nn.Module) -> bool:
    """Whether the model's mlx-lm module calls scaled_dot_product_attention, the hook the paged cache needs."""
    mod = sys.modules.get(type(model).__module__)
    return mod is not None and hasattr(mod, "scaled_dot_product_attention")
