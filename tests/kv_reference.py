"""Straightforward references for the paged cache, used only by tests.

`QuantRefCache` is mlx-lm's KVCache, except that the tokens of every page
completed before the current call are replaced by their quantize→dequantize
round trip: exactly what kvbatch stores, attended with plain full attention. Paging and batching must add no
error on top of it.
"""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class QuantRefCache(KVCache):
    def __init__(self, page_size: int, bits: int, group_size: int):
        super().__init__()
        self.P, self.qbits, self.qgroup = page_size, bits, group_size

    def _rt(self, x: mx.array, n: int) -> mx.array:
        if n == 0:
            return x
        q = mx.quantize(x[:, :, :n], group_size=self.qgroup, bits=self.qbits)
        deq = mx.dequantize(*q, group_size=self.qgroup, bits=self.qbits).astype(x.dtype)
        return mx.concatenate([deq, x[:, :, n:]], axis=2)

    def update_and_fetch(self, keys, values):
        sealed = (self.offset // self.P) * self.P  # pages completed before this call
        k, v = super().update_and_fetch(keys, values)
        return self._rt(k, sealed), self._rt(v, sealed)


def teacher_forced_logits(model, prompt: list[int], continuation: list[int], make_cache,
                          prefill_chunk: int = 1 << 30) -> list[mx.array]:
    """Single-stream logits for each generated step: the prompt (in chunks, as the engine
    prefills it: a chunk sees pages sealed before it quantized), then the continuation
    tokens one by one."""
    cache = make_cache()
    out = []
    for s in range(0, len(prompt), prefill_chunk):
        logits = model(mx.array([prompt[s:s + prefill_chunk]]), cache=cache)[0, -1]
    out.append(logits.astype(mx.float32))
    for t in continuation[:-1]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        out.append(logits.astype(mx.float32))
        mx.eval(out[-1])
    return out
