"""A row's K/V pages on disk: kept at a graceful stop, loaded when the row continues (a disk tier of the
prefix cache, as vLLM's KV offload / LMCache keep K/V beyond a process).

A stopped row's checkpoint (engine/resume.py) keeps its tokens; continuing from tokens alone prefills
them all again. `save` writes the row's *full* pages exactly as the store holds them (dense K/V, or
q8/q4/k8v4's packed codes, scales and biases; with kv.full_precision_tokens also the row's dense copy
of its first tokens), every layer, with the token ids they hold, into one safetensors file (written
to a temporary name, then renamed: a file is whole or absent). `load` reads one back and says why it
cannot be used: another format, another layout (mode, bits, group, page size, dtype, geometry),
another identity (what the caller says the K/V depends on beyond that: its model and settings), no
first page whose token ids are the row's, or a checksum that does not hold (truncated or corrupted).
Of a file that holds, the leading pages whose token ids are the row's are used (a page's K/V depends
only on the tokens up to its end). A file that does not hold is never used: the row prefills as it
would without one.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

import mlx.core as mx

from kvbatch.engine.kv.store import DenseStore, QuantizedStore

FORMAT = "kvbatch-row-kv/1"
Store = Union[DenseStore, QuantizedStore]


@dataclass(frozen=True)
class KVFile:
    """Where a row's K/V pages are kept on disk, and what they are valid for: `identity` is the caller's
    fingerprint of everything the K/V depends on beyond the cache's layout and the tokens (the model,
    its settings, the row's adapter)."""

    path: str
    identity: str


@dataclass
class RowKV:
    """A row's full pages read from disk and verified: `arrays` by name (see page_arrays), `tokens` the
    token ids of its leading pages that are the row's (a whole number of pages: `pages`)."""

    tokens: list[int]
    arrays: dict[str, mx.array]
    page_size: int

    @property
    def pages(self) -> int:
        """Full pages it holds for the row."""
        return len(self.tokens) // self.page_size


def _stored_pages(arrays: dict[str, mx.array]) -> int:
    return len(next(a for k, a in arrays.items() if k.startswith(("k.", "q."))))


def layout_of(store: Store, num_layers: int, rotated: bool) -> str:
    """What the stored bytes mean (rotated: keys stored turned by kv.rotate_keys): a file made under another
    layout is never read."""
    d = {"layers": num_layers, "kv_heads": store.kv_heads, "head_dim": store.head_dim, "rotated": rotated,
         "page_size": store.page_size, "dtype": str(store.dtype), "quantized": store.quantized}
    if isinstance(store, QuantizedStore):
        d.update(key_bits=store.key_bits, value_bits=store.value_bits, group_size=store.group_size,
                 k_axis=store.k_axis, full_precision=store.full_precision)
    return json.dumps(d, sort_keys=True)


def page_arrays(store: Store, pages: list[int], tail: Optional[int], first: int) -> dict[str, mx.array]:
    """The pages' arrays in every layer, as stored: dense `k.<layer>`, `v.<layer>`; quantized
    `q.<layer>.<0..5>` (K then V: packed, scales, biases) and, with full_precision tokens, `fk.<layer>`,
    `fv.<layer>`: the row's dense copy of its first `first` tokens (from its tail slot)."""
    idx = mx.array(pages, dtype=mx.int32)
    if isinstance(store, DenseStore):
        return {**{f"k.{i}": k[idx] for i, k in enumerate(store.k)},
                **{f"v.{i}": v[idx] for i, v in enumerate(store.v)}}
    out = {f"q.{i}.{j}": a[idx] for i, arrs in enumerate(store.q) for j, a in enumerate(arrs)}
    if first and tail is not None:
        out.update({f"fk.{i}": a[tail, :, :first] for i, a in enumerate(store.fk)})
        out.update({f"fv.{i}": a[tail, :, :first] for i, a in enumerate(store.fv)})
    return out


def put_pages(store: Store, rk: RowKV, start: int, pages: list[int], tail: Optional[int]) -> None:
    """Write pages start.. of `rk` into the store's pages `pages` (and its first-token copy into tail slot
    `tail`), every layer."""
    idx = mx.array(pages, dtype=mx.int32)
    src = slice(start, start + len(pages))
    a = rk.arrays
    if isinstance(store, DenseStore):
        for i in range(len(store.k)):
            store.k[i][idx] = a[f"k.{i}"][src]
            store.v[i][idx] = a[f"v.{i}"][src]
        mx.eval(store.k, store.v)
        return
    for i, arrs in enumerate(store.q):
        for j, buf in enumerate(arrs):
            buf[idx] = a[f"q.{i}.{j}"][src]
    if tail is not None and "fk.0" in a:
        n = a["fk.0"].shape[1]  # (kv_heads, tokens, head_dim)
        for i in range(len(store.fk)):
            store.fk[i][tail, :, :n] = a[f"fk.{i}"]
            store.fv[i][tail, :, :n] = a[f"fv.{i}"]
    mx.eval([b for arrs in store.q for b in arrs], store.fk, store.fv)


def _checksum(arrays: dict[str, mx.array]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        a = mx.contiguous(arrays[name])  # a slice (the first-token copy of one slot) is strided
        mx.eval(a)
        h.update(f"{name}:{a.dtype}:{tuple(a.shape)};".encode())
        h.update(memoryview(cast(Any, a)))  # MLX arrays are buffers (any dtype)
    return h.hexdigest()


def save(path: str, arrays: dict[str, mx.array], tokens: list[int], layout: str, identity: str) -> None:
    """Write a row's page arrays (page_arrays) holding `tokens` to `path` (a .safetensors name): a temporary
    file first, renamed once whole."""
    arrays = {**arrays, "tokens": mx.array(tokens, dtype=mx.uint32)}
    mx.eval(list(arrays.values()))
    meta = {"format": FORMAT, "layout": layout, "identity": identity, "checksum": _checksum(arrays)}
    tmp = path[:-len(".safetensors")] + ".tmp.safetensors"
    mx.save_safetensors(tmp, arrays, metadata=meta)
    os.replace(tmp, path)


def load(path: str, layout: str, identity: str, seq: list[int]) -> tuple[Optional[RowKV], str]:
    """(the file's pages, "") when it holds for a row of token sequence `seq` under this layout and
    identity; (None, why) otherwise. Never raises."""
    try:
        loaded = mx.load(path, return_metadata=True)
        assert isinstance(loaded, tuple)
        arrays, meta = loaded
        for key, want in (("format", FORMAT), ("layout", layout), ("identity", identity)):
            if meta.get(key) != want:
                return None, f"another {key}"
        if meta.get("checksum") != _checksum(arrays):
            return None, "checksum does not hold"
        tokens = [int(t) for t in cast(list, arrays.pop("tokens").tolist())]
        page_size = json.loads(layout)["page_size"]
        if not tokens or _stored_pages(arrays) * page_size != len(tokens):
            return None, "its pages do not hold its tokens"
        same = next((i for i, (a, b) in enumerate(zip(tokens, seq)) if a != b), min(len(tokens), len(seq)))
        if same < page_size:
            return None, "its tokens are not the row's"
        return RowKV(tokens[:same // page_size * page_size], arrays, page_size), ""  # pages of the row's tokens
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: the row prefills instead
        return None, f"unreadable ({type(e).__name__}: {e})"
